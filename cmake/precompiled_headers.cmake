# Precompiled headers. Parsing LibTorch's headers costs 10 to 20 s in every translation unit
# that includes them (ATen.h alone preprocesses to 157,000 lines), and most of ours do:
# precompiled once per build, they cost about 3 s to load. A file then compiles in 75 to 90% of
# the time: most of the rest is compiling the LibTorch templates it uses, which no precompiled
# header saves.
#
# GCC uses a precompiled header only where it was made with the same code-generation settings
# (-fPIC, optimization level, -fopenmp, macros such as GTEST_HAS_PTHREAD): one is made for the
# layers' libraries (position-independent), one for the tests (executables, with GoogleTest) and
# one for the programs (the examples and the programs the tests run: executables, without
# GoogleTest).
# Where the settings differ GCC falls back to reading the headers (-Winvalid-pch says so), so the
# result is the same either way. distoptim_optim keeps its own flags (-fopenmp, per-instruction-set
# kernels) and does without. The public-header checks (tests/headers) use the tests' set: with
# it they check our includes, not LibTorch's.
#
# A translation unit sees the precompiled headers whether it includes them or not: build with
# -DDISTOPTIM_PRECOMPILED_HEADERS=OFF to check that every file includes what it uses.
option(DISTOPTIM_PRECOMPILED_HEADERS "Precompile LibTorch's most used headers once per build" ON)

# What nearly every library file includes, directly or through our headers.
set(DISTOPTIM_PCH_LIBRARY_HEADERS
  <ATen/ATen.h>
  <torch/csrc/autograd/function.h>
  <torch/csrc/distributed/c10d/ProcessGroup.hpp>)
# And what the tests add: GoogleTest, LibTorch's modules and optimizers.
set(DISTOPTIM_PCH_TEST_HEADERS
  ${DISTOPTIM_PCH_LIBRARY_HEADERS}
  <gtest/gtest.h>
  <torch/nn/module.h>
  <torch/optim/optimizer.h>)
# And what the programs use: the tests' set without GoogleTest.
set(DISTOPTIM_PCH_PROGRAM_HEADERS
  ${DISTOPTIM_PCH_LIBRARY_HEADERS}
  <torch/nn/module.h>
  <torch/optim/optimizer.h>)

# distoptim_precompiled_header_maker(library|test|program): the target that makes the precompiled
# headers of that kind, once per build. The top level defines the library's and the tests' before
# the layers (CMakeLists.txt), so that Ninja, which starts the compiles that are ready in the order
# of its build file, makes them first; the programs' is defined where first used.
function(distoptim_precompiled_header_maker kind)
  set(maker distoptim_pch_${kind})
  if(NOT DISTOPTIM_PRECOMPILED_HEADERS OR TARGET ${maker})
    return()
  endif()
  set(source ${PROJECT_BINARY_DIR}/${maker}.cpp)
  if(NOT EXISTS ${source})
    file(WRITE ${source} "// Compiled only to make the precompiled headers.\n")
  endif()
  add_library(${maker} OBJECT ${source})
  target_link_libraries(${maker} PRIVATE torch)
  if(kind STREQUAL "library")
    target_precompile_headers(${maker} PRIVATE ${DISTOPTIM_PCH_LIBRARY_HEADERS})
    set_target_properties(${maker} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  elseif(kind STREQUAL "test")
    target_link_libraries(${maker} PRIVATE GTest::gtest)
    target_precompile_headers(${maker} PRIVATE ${DISTOPTIM_PCH_TEST_HEADERS})
  elseif(kind STREQUAL "program")
    target_precompile_headers(${maker} PRIVATE ${DISTOPTIM_PCH_PROGRAM_HEADERS})
  else()
    message(FATAL_ERROR "distoptim_precompiled_header_maker: kind '${kind}' is not library, test or program")
  endif()
endfunction()

# distoptim_precompiled_headers(TARGET library|test|program): TARGET uses the precompiled headers
# of its kind.
function(distoptim_precompiled_headers target kind)
  if(NOT DISTOPTIM_PRECOMPILED_HEADERS)
    return()
  endif()
  distoptim_precompiled_header_maker(${kind})
  target_precompile_headers(${target} REUSE_FROM distoptim_pch_${kind})
endfunction()
