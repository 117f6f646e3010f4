# Run by CTest with `cmake -P`: install -> configure consumer -> build consumer -> run consumer.
# Inputs: DISTOPTIM_BINARY_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, CXX_COMPILER, BUILD_TYPE,
# TORCH_DIR (may be empty).
cmake_minimum_required(VERSION 3.18)

foreach(var DISTOPTIM_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_install_test.cmake: ${var} is not set")
  endif()
endforeach()
if("${BUILD_TYPE}" STREQUAL "")
  set(BUILD_TYPE Release)
endif()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Runs one step, failing the test with the step's name if it fails.
function(run_step name)
  string(JOIN " " command_line ${ARGN})
  message(STATUS "install test: ${name}: ${command_line}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "install test: ${name} failed (${result})")
  endif()
endfunction()

run_step("install" ${CMAKE_COMMAND} --install "${DISTOPTIM_BINARY_DIR}" --prefix "${prefix}")

set(configure_args
  -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}"
  -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_PREFIX_PATH=${prefix}
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DDISTOPTIM_EXPECTED_PREFIX=${prefix})
if(NOT "${TORCH_DIR}" STREQUAL "")
  list(APPEND configure_args -DTorch_DIR=${TORCH_DIR})
endif()
run_step("configure consumer" ${CMAKE_COMMAND} ${configure_args})
run_step("build consumer" ${CMAKE_COMMAND} --build "${consumer_build}" -j 2)
run_step("run consumer" "${consumer_build}/distoptim_consumer")
