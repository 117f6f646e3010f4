#pragma once

// Running code when a local backward pass ends, after the callbacks others queued during it.

#include <functional>
#include <utility>

#include <torch/csrc/autograd/engine.h>

namespace distoptim {
namespace data_parallel {

/// From inside a backward pass (a hook): runs `callback` on the caller's thread when the pass
/// ends, before backward() returns, after every final callback queued during the pass, such as
/// c10d::Reducer's finalization, which it queues only once the last bucket is ready. The engine
/// runs final callbacks in order, including those queued while they run: queued from one of
/// them, `callback` comes last.
inline void queue_after_pass_callbacks(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(
      [callback = std::move(callback)]() mutable {
        torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
      });
}

}  // namespace data_parallel
}  // namespace distoptim
