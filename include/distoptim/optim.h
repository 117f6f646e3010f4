#pragma once

// Layer 1 of distoptim: functional optimizers, their registry and LibTorch adapters.
#include <distoptim/optim/adadelta.h>
#include <distoptim/optim/adagrad.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/adamax.h>
#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/libtorch_optimizer_adapter.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/rmsprop.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/optim/sparse_adam.h>
#include <distoptim/optim/torch_adapter.h>
#include <distoptim/optim/torchscript_optimizer.h>
