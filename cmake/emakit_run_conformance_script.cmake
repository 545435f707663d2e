# Runs one conformance generator: cmake -DPYTHON=... -DSCRIPT=... -DOUT=... -P this file.
#
# Every way this can go wrong is a failure (FATAL_ERROR: ctest reports the generator failed and
# the replays that need its data are not run): PYTHON missing, the generator exiting non-zero
# (a peer package that does not import ends it with the ImportError), no output. There is no
# skip here. The one skip, a build without any Python (EMAKIT_PYTHON empty: PyPI unreachable and
# EMAKIT_ALLOW_SKIP=torch2), is registered by tests/CMakeLists.txt as a command that exits 77
# instead of this script, since `cmake -P` cannot end with exit status 77.
#
# A generator with a recorded fixture (-DFIXTURE=<stem>.tar.xz -DFIXTURE_INFO=<stem>.txt
# -DREQUIREMENTS=scripts/requirements-seed.txt -DCOMPARE=_compare_outputs.py; the seed packages,
# tests/conformance/fixtures/):
#   - in both modes the fixture must not be stale: every package version recorded in
#     FIXTURE_INFO is a pin of REQUIREMENTS, and the sha256 of the generator and of _common.py
#     are the recorded ones.
#   - without PYTHON (the default run) the fixture is unpacked into OUT instead, after checking
#     that it is what was recorded: the archive's sha256 is the one in FIXTURE_INFO, and the
#     versions.txt inside the archive lists exactly the versions FIXTURE_INFO records.
#   - with PYTHON (the seed venv, EMAKIT_SEED_PACKAGES=1) the generator runs for real into OUT,
#     the versions it drove must be the pins, and its live output is diffed with the committed
#     fixture (COMPARE, run with PYTHON: the same files, tensors bitwise equal); drift fails.

cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)

# check_versions(FILE WHAT): each "name==version" line of FILE is a line of REQUIREMENTS.
function(check_versions file what)
  file(STRINGS "${REQUIREMENTS}" pins REGEX "^[A-Za-z0-9_.-]+==")
  file(STRINGS "${file}" used REGEX "==")
  if(NOT used)
    message(FATAL_ERROR "${what}: ${file} records no package version")
  endif()
  foreach(line IN LISTS used)
    string(STRIP "${line}" line)
    if(NOT line IN_LIST pins)
      message(FATAL_ERROR "${what} was made with ${line}, which is not a pin of ${REQUIREMENTS} (${pins}): "
                          "regenerate the fixture with ./scripts/seed_fixtures.sh")
    endif()
  endforeach()
endfunction()

# check_recorded_sha256(FILE WHAT): FIXTURE_INFO's line "sha256 <FILE's name> <hash>" is FILE's
# sha256; otherwise fails with WHAT (what a mismatch means) and the two hashes.
function(check_recorded_sha256 file what)
  get_filename_component(name "${file}" NAME)
  file(SHA256 "${file}" now)
  file(STRINGS "${FIXTURE_INFO}" recorded REGEX "^sha256 ${name} ")
  if(NOT recorded STREQUAL "sha256 ${name} ${now}")
    message(FATAL_ERROR "${what}: the sha256 of ${name} is ${now}, ${FIXTURE_INFO} records '${recorded}'; "
                        "regenerate the fixture with ./scripts/seed_fixtures.sh")
  endif()
endfunction()

# unpack_fixture(DESTINATION_PARENT): checks FIXTURE against FIXTURE_INFO and unpacks it; the
# archive holds one folder named like OUT.
function(unpack_fixture parent)
  if(NOT EXISTS "${FIXTURE}" OR NOT EXISTS "${FIXTURE_INFO}")
    message(FATAL_ERROR "the fixture ${FIXTURE} (or ${FIXTURE_INFO}) is missing")
  endif()
  check_recorded_sha256("${FIXTURE}" "the fixture ${FIXTURE} is not the recorded one")
  get_filename_component(stem "${OUT}" NAME)
  file(REMOVE_RECURSE "${parent}/${stem}")
  file(MAKE_DIRECTORY "${parent}")
  file(ARCHIVE_EXTRACT INPUT "${FIXTURE}" DESTINATION "${parent}")
  if(NOT EXISTS "${parent}/${stem}/versions.txt")
    message(FATAL_ERROR "the fixture ${FIXTURE} did not unpack into ${parent}/${stem} (no versions.txt)")
  endif()
  # The archive's versions.txt must be the versions FIXTURE_INFO records, no more, no fewer.
  file(STRINGS "${parent}/${stem}/versions.txt" inside REGEX "==")
  file(STRINGS "${FIXTURE_INFO}" outside REGEX "^[A-Za-z0-9_.-]+==")
  list(SORT inside)
  list(SORT outside)
  if(NOT inside STREQUAL outside)
    message(FATAL_ERROR "the fixture ${FIXTURE} holds versions.txt '${inside}' but ${FIXTURE_INFO} records "
                        "'${outside}'; regenerate both with ./scripts/seed_fixtures.sh")
  endif()
endfunction()

if(NOT PYTHON AND NOT FIXTURE)
  message(FATAL_ERROR "no PYTHON given for ${SCRIPT} (tests/CMakeLists.txt registers the no-Python skip itself)")
endif()
if(PYTHON AND NOT EXISTS "${PYTHON}")
  message(FATAL_ERROR "the Python ${PYTHON} does not exist, so ${SCRIPT} cannot run (reconfigure with the "
                      "venv's Python, or EMAKIT_PYTHON= for a build without Python)")
endif()

if(FIXTURE)
  # Stale fixture (in both modes: a live run must not pass while the default run would fail):
  # the generator's code changed since it was recorded, or a version it records is not a pin.
  if(NOT EXISTS "${FIXTURE_INFO}")
    message(FATAL_ERROR "the fixture record ${FIXTURE_INFO} is missing")
  endif()
  get_filename_component(dir "${SCRIPT}" DIRECTORY)
  foreach(source "${SCRIPT}" "${dir}/_common.py")
    get_filename_component(name "${source}" NAME)
    check_recorded_sha256("${source}" "stale fixture ${FIXTURE}: ${name} changed since it was recorded")
  endforeach()
  check_versions("${FIXTURE_INFO}" "the fixture ${FIXTURE}")
endif()

if(FIXTURE AND NOT PYTHON)
  get_filename_component(parent "${OUT}" DIRECTORY)
  unpack_fixture("${parent}")
  file(STRINGS "${OUT}/versions.txt" versions)
  string(REPLACE ";" ", " versions "${versions}")
  message("replayed from the recorded fixture ${FIXTURE} (${versions}; sha256 checked); the real packages run "
          "with EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh")
  return()
endif()

file(REMOVE_RECURSE "${OUT}")
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" "${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SCRIPT} failed with exit status ${rc} under ${PYTHON} (its output is above: an "
                      "ImportError means the peer package does not import in that venv; the pins are "
                      "scripts/requirements.txt and scripts/requirements-seed.txt)")
endif()
file(GLOB_RECURSE written "${OUT}/*")
list(LENGTH written count)
if(count EQUAL 0)
  message(FATAL_ERROR "${SCRIPT} exited 0 but wrote nothing under ${OUT}")
endif()
message("${SCRIPT} wrote ${count} files under ${OUT}")

if(FIXTURE)
  if(NOT EXISTS "${OUT}/versions.txt")
    message(FATAL_ERROR "${SCRIPT} wrote no ${OUT}/versions.txt")
  endif()
  check_versions("${OUT}/versions.txt" "${SCRIPT}'s run")
  # Drift: the live output against the committed fixture (unpacked beside OUT, then removed).
  set(recorded "${OUT}.fixture")
  unpack_fixture("${recorded}")
  get_filename_component(stem "${OUT}" NAME)
  execute_process(COMMAND "${PYTHON}" "${COMPARE}" "${OUT}" "${recorded}/${stem}" RESULT_VARIABLE rc)
  file(REMOVE_RECURSE "${recorded}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the live output of ${SCRIPT} differs from the committed fixture ${FIXTURE} (DRIFT lines "
                        "above): the package or the platform changed what it computes; if that is expected, "
                        "regenerate the fixture with ./scripts/seed_fixtures.sh and commit it")
  endif()
endif()
