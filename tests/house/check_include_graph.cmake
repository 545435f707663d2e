# The house rule of emakit's headers, checked over the include graph (ctest house.include_graph):
#
#   1. No header under include/emakit/detail/ includes a public header other than the vocabulary
#      headers below (leaf headers that name types every layer needs), so that no detail header
#      reaches ema.hpp or anything built on it.
#   2. The vocabulary headers include nothing of emakit but detail/ headers and each other.
#   3. Hence, checked over the whole graph: from no detail/ header is ema.hpp (or any public header
#      outside the vocabulary) reachable. Each violation is named with its include chain.
#
#   cmake -DEMAKIT_INCLUDE_DIR=<repo>/include -P check_include_graph.cmake
#
# A header's edges are its `#include <emakit/...>` lines, its -inl.hpp's included (an -inl file is
# the second half of its header).
cmake_minimum_required(VERSION 3.20)
if(NOT EMAKIT_INCLUDE_DIR)
  message(FATAL_ERROR "check_include_graph: pass -DEMAKIT_INCLUDE_DIR=<repo>/include")
endif()

set(vocabulary
  emakit/state.hpp emakit/concepts.hpp emakit/options.hpp emakit/version.hpp)

file(GLOB_RECURSE headers RELATIVE "${EMAKIT_INCLUDE_DIR}" "${EMAKIT_INCLUDE_DIR}/emakit/*.hpp")
list(SORT headers)
list(LENGTH headers header_count)
if(header_count LESS 40)
  message(FATAL_ERROR "check_include_graph: found ${header_count} headers under ${EMAKIT_INCLUDE_DIR}/emakit; expected the whole library (40 or more)")
endif()

# The edges of each header (its -inl part merged into it).
set(edge_count 0)
foreach(h IN LISTS headers)
  string(REGEX REPLACE "-inl\\.hpp$" ".hpp" owner "${h}")
  file(STRINGS "${EMAKIT_INCLUDE_DIR}/${h}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*<emakit/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<([^>]+)>.*$" "\\1" target "${line}")
    string(REGEX REPLACE "-inl\\.hpp$" ".hpp" target "${target}")
    if(target STREQUAL owner)
      continue()
    endif()
    if(NOT EXISTS "${EMAKIT_INCLUDE_DIR}/${target}")
      message(FATAL_ERROR "check_include_graph: ${h} includes <${target}>, which does not exist")
    endif()
    string(MAKE_C_IDENTIFIER "${owner}" id)
    list(APPEND edges_${id} "${target}")
    math(EXPR edge_count "${edge_count} + 1")
  endforeach()
endforeach()

function(allowed_public from target out)
  set(ok TRUE)
  if(NOT target MATCHES "^emakit/detail/" AND NOT target IN_LIST vocabulary)
    set(ok FALSE)
  endif()
  set(${out} ${ok} PARENT_SCOPE)
endfunction()

set(violations "")
set(checked 0)
foreach(h IN LISTS headers)
  if(h MATCHES "-inl\\.hpp$")
    continue()
  endif()
  set(is_detail FALSE)
  if(h MATCHES "^emakit/detail/")
    set(is_detail TRUE)
  endif()
  if(NOT is_detail AND NOT h IN_LIST vocabulary)
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  # Breadth-first over the graph from h; `via_<id>` remembers the chain.
  set(queue "${h}")
  set(seen "${h}")
  string(MAKE_C_IDENTIFIER "${h}" hid)
  set(via_${hid} "${h}")
  while(queue)
    list(POP_FRONT queue cur)
    string(MAKE_C_IDENTIFIER "${cur}" cid)
    foreach(next IN LISTS edges_${cid})
      if(next IN_LIST seen)
        continue()
      endif()
      list(APPEND seen "${next}")
      string(MAKE_C_IDENTIFIER "${next}" nid)
      set(via_${nid} "${via_${cid}} -> ${next}")
      allowed_public("${h}" "${next}" ok)
      if(NOT ok)
        string(APPEND violations "\n  ${via_${nid}}")
      else()
        list(APPEND queue "${next}")
      endif()
    endforeach()
  endwhile()
endforeach()

if(violations)
  message(FATAL_ERROR "check_include_graph: a detail/ or vocabulary header reaches a public header above it "
    "(allowed from detail/: detail/ headers and the vocabulary ${vocabulary}); move what it needs into a "
    "detail/ or vocabulary header:${violations}")
endif()
if(checked LESS 20 OR edge_count LESS 100)
  message(FATAL_ERROR "check_include_graph: checked ${checked} detail/vocabulary headers over ${edge_count} edges; "
    "expected at least 20 and 100: did the include pattern stop matching?")
endif()
message(STATUS "check_include_graph: ${header_count} headers, ${edge_count} include edges; "
  "${checked} detail/ and vocabulary headers reach no public header above them")
