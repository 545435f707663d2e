# Runs one conformance generator: cmake -DPYTHON=... -DSCRIPT=... -DOUT=... -P this file.
# Without a Python (no venv: PyPI unreachable) it prints a SKIPPED: line, which ctest counts
# as a skipped test; a generator that cannot import its package writes OUT.skipped itself.
#
# A generator with a recorded fixture (-DFIXTURE=<stem>.tar.xz -DFIXTURE_INFO=<stem>.txt
# -DREQUIREMENTS=scripts/requirements-seed.txt; the seed packages, tests/conformance/fixtures/):
# without PYTHON (the default run) the fixture is unpacked into OUT instead, after checking that
# it is not stale: the package versions it was recorded with must be the pins of REQUIREMENTS,
# and the sha256 of the generator and of _common.py must be the recorded ones. With PYTHON (the
# seed venv, EMAKIT_SEED_PACKAGES=1) the generator runs for real, and the versions it drove must
# be the pins as well.

cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)

# check_versions(FILE): each "name==version" line of FILE is a line of REQUIREMENTS.
function(check_versions file what)
  file(STRINGS "${REQUIREMENTS}" pins REGEX "^[A-Za-z0-9_.-]+==")
  file(STRINGS "${file}" used REGEX "==")
  foreach(line IN LISTS used)
    string(STRIP "${line}" line)
    if(NOT line IN_LIST pins)
      message(FATAL_ERROR "${what} was made with ${line}, which is not a pin of ${REQUIREMENTS} (${pins}): "
                          "regenerate the fixture with ./scripts/seed_fixtures.sh")
    endif()
  endforeach()
endfunction()

if(FIXTURE AND (NOT PYTHON OR NOT EXISTS "${PYTHON}"))
  if(NOT EXISTS "${FIXTURE}" OR NOT EXISTS "${FIXTURE_INFO}")
    message(FATAL_ERROR "the fixture ${FIXTURE} (or ${FIXTURE_INFO}) is missing")
  endif()
  # Stale fixture: the generator's code changed since it was recorded.
  get_filename_component(dir "${SCRIPT}" DIRECTORY)
  foreach(source "${SCRIPT}" "${dir}/_common.py")
    get_filename_component(name "${source}" NAME)
    file(SHA256 "${source}" now)
    file(STRINGS "${FIXTURE_INFO}" recorded REGEX "^sha256 ${name} ")
    if(NOT recorded STREQUAL "sha256 ${name} ${now}")
      message(FATAL_ERROR "stale fixture ${FIXTURE}: ${name} changed since it was recorded "
                          "(recorded '${recorded}', now ${now}); regenerate it with ./scripts/seed_fixtures.sh")
    endif()
  endforeach()
  check_versions("${FIXTURE_INFO}" "the fixture ${FIXTURE}")
  file(REMOVE_RECURSE "${OUT}")
  file(REMOVE "${OUT}.skipped")
  get_filename_component(parent "${OUT}" DIRECTORY)
  file(ARCHIVE_EXTRACT INPUT "${FIXTURE}" DESTINATION "${parent}")
  if(NOT EXISTS "${OUT}/versions.txt")
    message(FATAL_ERROR "the fixture ${FIXTURE} did not unpack into ${OUT}")
  endif()
  file(STRINGS "${OUT}/versions.txt" versions)
  string(REPLACE ";" ", " versions "${versions}")
  message("replayed from the recorded fixture ${FIXTURE} (${versions}); the real packages run with "
          "EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh")
  return()
endif()

if(NOT PYTHON OR NOT EXISTS "${PYTHON}")
  message("SKIPPED: no Python with the reference packages (EMAKIT_PYTHON is unset); "
          "${SCRIPT} did not run")
  return()
endif()
file(REMOVE_RECURSE "${OUT}")
file(REMOVE "${OUT}.skipped")
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" "${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SCRIPT} failed with exit status ${rc}")
endif()
if(EXISTS "${OUT}.skipped")
  file(READ "${OUT}.skipped" reason)
  message("SKIPPED: ${reason}")
elseif(FIXTURE AND REQUIREMENTS AND EXISTS "${OUT}/versions.txt")
  check_versions("${OUT}/versions.txt" "${SCRIPT}'s run")
endif()
