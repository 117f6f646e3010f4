#pragma once

// The launcher behind `distrun`: its options, their parsing and validation, the environment each
// rank gets, and the supervisor that starts the local ranks, relays their output and stops them
// all when one fails. Used by tools/distrun/main.cpp and by the tests; not part of the installed
// library. It starts any program, so its errors derive from the standard exceptions instead of
// c10::Error. It does not link LibTorch: the store the nodes of a job with restarts coordinate
// through, and the etcd backend's check, are in its store module, loaded only when a job needs
// them (store_module.h).
//
// options.h: the command line and each rank's environment; supervisor.h: run(), the state
// machine, which uses rank_process.h (a rank's process: start, signal, reap), output_relay.h (a
// rank's output), signals_fds.h (descriptors, the self-pipe for signals), restart_policy.h
// (whether and how ranks start again), job_report.h (the summary at the end) and, across nodes
// with restarts, node_coordination.h (the rounds every node goes through together, in the store
// module).

#include "distrun/options.h"
#include "distrun/supervisor.h"
