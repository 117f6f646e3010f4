#pragma once

// Which sanitizer a test is compiled under, for GCC and clang alike: GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__, clang 14 answers only __has_feature. The
// sanitizer builds (scripts/test.sh) use clang, the other builds GCC.
//
// DISTOPTIM_UNDER_ASAN and DISTOPTIM_UNDER_TSAN are 1 under AddressSanitizer and
// ThreadSanitizer, 0 otherwise.

#if defined(__has_feature)
#define DISTOPTIM_HAS_FEATURE(feature) __has_feature(feature)
#else
#define DISTOPTIM_HAS_FEATURE(feature) 0
#endif

#if defined(__SANITIZE_ADDRESS__) || DISTOPTIM_HAS_FEATURE(address_sanitizer)
#define DISTOPTIM_UNDER_ASAN 1
#else
#define DISTOPTIM_UNDER_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__) || DISTOPTIM_HAS_FEATURE(thread_sanitizer)
#define DISTOPTIM_UNDER_TSAN 1
#else
#define DISTOPTIM_UNDER_TSAN 0
#endif
