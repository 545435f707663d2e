#!/usr/bin/env python3
"""Check docs/tests.md's table "Which file tests which header" against the tree.

The table has one row per header under include/emakit (an -inl.hpp file is tested with its
header and has no row): the header in backticks in the first cell (`emakit/ema.hpp`), and in
the second cell, in backticks, the test files that test it (`tests/test_ema.cpp`), as paths
from the repository root. This script fails, naming each problem, when
  - a header under include/emakit has no row,
  - a row names a header that does not exist (or an -inl.hpp file),
  - a row names no test file, or a test file that does not exist,
  - a header has two rows.
ctest runs it as docs.header_test_table (label docs; tests/docs/CMakeLists.txt).

  check_test_table.py --root REPO [--page docs/tests.md]

Python 3 standard library only.
"""
import argparse
import pathlib
import re
import sys

SECTION = "## Which file tests which header"
CODE = re.compile(r"`([^`]+)`")


def table_rows(page):
    """(line number, header, [test files]) for each row of the section's table."""
    lines = page.read_text(encoding="utf-8").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
    except StopIteration:
        sys.exit(f"{page}: no section '{SECTION}': the header -> test table is checked by "
                 "tests/docs/check_test_table.py; restore the heading or update the script")
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        header = CODE.findall(cells[0])
        if len(header) != 1 or not header[0].startswith("emakit/"):
            continue  # the heading row
        tests = CODE.findall(cells[1]) if len(cells) > 1 else []
        rows.append((number, header[0], tests))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=pathlib.Path, help="the repository root")
    parser.add_argument("--page", default="docs/tests.md", help="the page, relative to --root")
    args = parser.parse_args()
    root, page = args.root.resolve(), args.root.resolve() / args.page

    include = root / "include"
    on_disk = {p.relative_to(include).as_posix() for p in (include / "emakit").rglob("*.hpp")
               if not p.name.endswith("-inl.hpp")}
    rows = table_rows(page)
    problems, seen = [], {}
    for number, header, tests in rows:
        where = f"{args.page}:{number}"
        if header in seen:
            problems.append(f"{where}: '{header}' has a second row (the first is line {seen[header]}); "
                            "keep one row per header")
        seen.setdefault(header, number)
        if header.endswith("-inl.hpp"):
            problems.append(f"{where}: '{header}' is an -inl.hpp file, tested with its header; "
                            "remove the row")
        elif header not in on_disk:
            problems.append(f"{where}: '{header}' is not a header under include/ "
                            "(renamed or removed?); fix or remove the row")
        if not tests:
            problems.append(f"{where}: '{header}' names no test file; add the tests/... file(s) "
                            "that test it, in backticks, in the second cell")
        for test in tests:
            if not (root / test).is_file():
                problems.append(f"{where}: test file '{test}' of '{header}' does not exist; "
                                "give its path from the repository root")
    for header in sorted(on_disk - seen.keys()):
        problems.append(f"include/{header}: no row in {args.page}, '{SECTION[3:]}'; add "
                        f"'| `{header}` | `tests/...` | ... |' naming the file(s) that test it")
    if problems:
        print("\n".join(problems))
        print(f"{len(problems)} problem(s) in the header -> test table of {args.page} "
              f"({len(rows)} rows, {len(on_disk)} headers under include/emakit)")
        return 1
    print(f"{args.page}: {len(rows)} rows, one per header under include/emakit, every test file exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
