#!/usr/bin/env bash
# Formats emakit's C++ files with clang-format 14 and the repository's .clang-format: every
# *.cpp, *.hpp and *.h under include/, src/, tests/, examples/ and benchmarks/ that git tracks or
# would track (untracked files that .gitignore does not exclude count too), except
# tests/fixtures/ (generators kept as they were run).
#
#   ./scripts/format.sh            reformat those files in place
#   ./scripts/format.sh --check    change nothing; exit 1 naming each file that differs
#                                  (scripts/test.sh runs this first, as the `format` stage)
#
# The output depends on clang-format's version, so the version is pinned: clang-format-14
# (Debian's clang-format-14, installed when missing unless EMAKIT_NO_INSTALL=1);
# EMAKIT_CLANG_FORMAT names another binary of version 14.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) emakit_die "unknown argument '$1' (known: --check)" ;;
esac

clang_format="${EMAKIT_CLANG_FORMAT:-clang-format-14}"
if [[ -z "${EMAKIT_CLANG_FORMAT:-}" ]] && ! command -v "$clang_format" >/dev/null; then
  emakit_apt_ensure clang-format-14
fi
command -v "$clang_format" >/dev/null \
  || emakit_die "$clang_format not found: install it (sudo apt-get install clang-format-14) or set EMAKIT_CLANG_FORMAT"
version="$("$clang_format" --version)"
[[ "$version" =~ version\ 14\. ]] \
  || emakit_die "$clang_format is '$version'; .clang-format is tuned for clang-format 14 (set EMAKIT_CLANG_FORMAT to a version 14 binary)"

dirs=(include src tests examples benchmarks)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files --cached --others --exclude-standard -- "${dirs[@]}" \
                         | grep -E '\.(cpp|hpp|h)$' | grep -v '^tests/fixtures/' | sort -u)
else
  mapfile -t files < <(find "${dirs[@]}" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) \
                         -not -path 'tests/fixtures/*' | sort)
fi
((${#files[@]} > 0)) || emakit_die "no C++ files found under ${dirs[*]}"
# A file git still lists but that was deleted in the working tree is not there to format.
present=()
for f in "${files[@]}"; do [[ -f "$f" ]] && present+=("$f"); done

if ((check == 0)); then
  "$clang_format" -i --style=file "${present[@]}"
  emakit_say "formatted ${#present[@]} files ($version)"
  exit 0
fi

# The formatted text compared with the file (clang-format 14's --dry-run also flags namespace
# comments it would rewrite to the same text, so its warnings are not the test).
differ=()
formatted="$(mktemp)"
trap 'rm -f "$formatted"' EXIT
for f in "${present[@]}"; do
  "$clang_format" --style=file "$f" >"$formatted"
  if ! cmp -s "$formatted" "$f"; then
    n="$(diff "$formatted" "$f" | grep -c '^>' || true)"
    differ+=("$f ($n line$([[ "$n" == 1 ]] || echo s) to change)")
  fi
done
if ((${#differ[@]} == 0)); then
  printf '==> [format] PASSED: %d C++ files as .clang-format says (%s)\n' "${#present[@]}" "$version"
  exit 0
fi
printf '    %s\n' "${differ[@]}"
printf '==> [format] FAILED: %d of %d C++ files are not formatted as .clang-format says (listed above); run ./scripts/format.sh and commit the result\n' \
  "${#differ[@]}" "${#present[@]}"
exit 1
