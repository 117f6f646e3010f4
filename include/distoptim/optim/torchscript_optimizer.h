#pragma once

// Functional optimizers written in Python as TorchScript, the seed's "distributed optimizer with
// TorchScript support" recipe: a torch.nn.Module whose exported methods give the defaults, make a
// parameter's state and apply one update, scripted and saved with torch.jit.save
// (examples/custom_qhm/qhm_torchscript.py is the seed's QHM so; docs/optim.md gives the recipe).
// Registered under a name, it is used wherever a built-in is: the DistributedOptimizer (on every
// owner that registered it), the ZeroRedundancyOptimizer, the torch::optim adapter, state dicts and
// checkpoints. Its update runs in LibTorch's TorchScript interpreter on the calling thread: no
// Python, no global lock, so several optimizers (several trainers' on one owner) step at once.
//
//   distoptim::optim::register_torchscript_optimizer("qhm_script", "qhm.pt");
//   auto qhm = distoptim::optim::create_optimizer("qhm_script", {ParamGroup(params)},
//                                                 OptionBag().set("lr", 0.05));

#include <string>

namespace distoptim {
namespace optim {

/// Loads the TorchScript module saved at `path` and registers it in the optimizer registry as
/// `name`. The module must have (as exported methods; docs/optim.md):
///   defaults() -> Dict[str, float]
///   init_state(param: Tensor) -> Dict[str, Tensor]
///   update(params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
///          steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]
/// and may have check_options(options: Dict[str, float]) -> None, which raises for options it
/// refuses. Options are the defaults' keys, numbers (an option not among them is refused, naming
/// them); a parameter's state is what init_state makes at its first gradient (its keys, in order,
/// are the state's names), then what update returns; update gets the parameters of one group that
/// have a gradient this step, with their states and step counts (this step's included), under
/// no_grad, and must return a state for each, with every name, each tensor of its parameter's
/// shape. Sparse gradients are refused.
///
/// Errors, registering nothing: c10::ValueError naming `path` and what is wrong: not a TorchScript
/// archive (a missing file included), a method missing or with another signature (both
/// signatures named), init_state or defaults failing or giving something unusable; the
/// registry's error for a name taken. At a step: the script's own failure (its TorchScript
/// traceback names the file and line), and c10::ValueError naming `path` and the parameter for a
/// state update does not return; a failure midway leaves what the script changed before it.
void register_torchscript_optimizer(const std::string& name, const std::string& path);

}  // namespace optim
}  // namespace distoptim
