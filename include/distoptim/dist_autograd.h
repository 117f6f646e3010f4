#pragma once

// Layer 5 of distoptim: distributed autograd (torch.distributed.autograd).
#include <distoptim/dist_autograd/context.h>
