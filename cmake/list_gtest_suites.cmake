# Run after a test binary is built (cmake -P): lists its GoogleTest suites and how many cases
# each has, for the CTest file tests/CMakeLists.txt generates (one CTest test per suite).
#   -D TEST_EXECUTABLE=path  the binary
#   -D TEST_NAME=name        its target's name (prefix of the variables written)
#   -D OUTPUT=file           written: set(<name>_SUITES ...) and set(<name>_CASES ...), the
#                            suites' names and their numbers of cases, in the same order
foreach(required TEST_EXECUTABLE TEST_NAME OUTPUT)
  if(NOT DEFINED ${required})
    message(FATAL_ERROR "list_gtest_suites.cmake: -D ${required}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
  OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 60)
if(NOT status EQUAL 0)
  file(REMOVE "${OUTPUT}")
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests exited with ${status}:\n${errors}")
endif()

# The listing: a suite's name at the start of a line, ending with '.' (a comment may follow),
# then its cases indented by two spaces. `counts` holds each suite's number of cases.
string(REPLACE ";" "\\;" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
set(counts "")
foreach(line IN LISTS lines)
  if(line MATCHES "^  [^ ]")
    list(POP_BACK counts count)
    math(EXPR count "${count} + 1")
    list(APPEND counts ${count})
  elseif(line MATCHES "^([^ #]+)\\.")
    list(APPEND suites "${CMAKE_MATCH_1}")
    list(APPEND counts 0)
  endif()
endforeach()
file(WRITE "${OUTPUT}"
  "set(${TEST_NAME}_SUITES [==[${suites}]==])\nset(${TEST_NAME}_CASES [==[${counts}]==])\n")
