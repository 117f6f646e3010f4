# Run after a test binary is built (cmake -P): lists its GoogleTest suites, how many cases each
# has and the files the cases are in, for the CTest files tests/CMakeLists.txt generates (one CTest
# test per suite, in the group of the suite's files).
#   -D TEST_EXECUTABLE=path  the binary
#   -D TEST_NAME=name        its target's name (prefix of the variables written)
#   -D OUTPUT=file           written: set(<name>_SUITES ...), set(<name>_CASES ...) and
#                            set(<name>_FILES ...), the suites' names, their numbers of cases and
#                            their cases' files (joined by '|'), in the same order
foreach(required TEST_EXECUTABLE TEST_NAME OUTPUT)
  if(NOT DEFINED ${required})
    message(FATAL_ERROR "list_gtest_suites.cmake: -D ${required}=... is required")
  endif()
endforeach()

# GoogleTest writes the listing as JSON, each case with its file.
set(listing_file "${OUTPUT}.json")
file(REMOVE "${listing_file}")
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests "--gtest_output=json:${listing_file}"
  OUTPUT_QUIET ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 60)
if(NOT status EQUAL 0 OR NOT EXISTS "${listing_file}")
  file(REMOVE "${OUTPUT}")
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests exited with ${status}:\n${errors}")
endif()
file(READ "${listing_file}" listing)
file(REMOVE "${listing_file}")

set(suites "")
set(counts "")
set(suite_files "")
string(JSON suite_count LENGTH "${listing}" testsuites)
if(suite_count GREATER 0)
  math(EXPR last_suite "${suite_count} - 1")
  foreach(s RANGE ${last_suite})
    string(JSON suite GET "${listing}" testsuites ${s} name)
    string(JSON cases LENGTH "${listing}" testsuites ${s} testsuite)
    set(files "")
    math(EXPR last_case "${cases} - 1")
    foreach(c RANGE ${last_case})
      string(JSON file GET "${listing}" testsuites ${s} testsuite ${c} file)
      list(APPEND files "${file}")
    endforeach()
    list(REMOVE_DUPLICATES files)
    list(JOIN files "|" files)
    list(APPEND suites "${suite}")
    list(APPEND counts ${cases})
    list(APPEND suite_files "${files}")
  endforeach()
endif()
file(WRITE "${OUTPUT}"
  "set(${TEST_NAME}_SUITES [==[${suites}]==])\nset(${TEST_NAME}_CASES [==[${counts}]==])\n"
  "set(${TEST_NAME}_FILES [==[${suite_files}]==])\n")
