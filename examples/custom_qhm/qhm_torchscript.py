"""The seed's functional QHM as a TorchScript optimizer distoptim loads by file.

Usage: python3 qhm_torchscript.py OUT.pt   (PyTorch 1.13; writes OUT.pt with torch.jit.save)

Then, in C++, on every process that builds the optimizer (a DistributedOptimizer's owners too):

    distoptim::optim::register_torchscript_optimizer("qhm_script", "OUT.pt");
    DistributedOptimizer optimizer("qhm_script", params, OptionBag().set("lr", 0.01));

The recipe (docs/optim.md): a torch.nn.Module, scripted and saved, with four exported methods.
  defaults() -> Dict[str, float]        every option and its default
  init_state(param) -> Dict[str, Tensor] a parameter's state before its first step (the names,
                                         in this order, are the state's names in state dicts)
  update(params, grads, states, steps, options) -> List[Dict[str, Tensor]]
                                         one step of the parameters that have a gradient: their
                                         states (as init_state made them, or as the last update
                                         returned them), their step counts (this step's
                                         included), the group's options; returns every
                                         parameter's state after the step
  check_options(options) -> None        optional: raises for options it refuses
The update runs under torch.no_grad(). qhm_update below is the seed's, with its deprecated
`add_(scalar, tensor)` calls (which script, but fail at run time in PyTorch 1.13: "Cannot input a
tensor of dimension other than 0 as a scalar argument") written with `alpha=`; the seed's
FunctionalQHM read `self.state[param]` before anything made it (a KeyError at the first step):
here distoptim makes the state with init_state.
"""

import sys
from typing import Dict, List

import torch
from torch import Tensor


def qhm_update(params: List[Tensor], dp_list: List[Tensor], momentum_buffer_list: List[Tensor],
               lr: float, nu: float, weight_decay: float, weight_decay_type: str,
               momentum: float):
    for p, d_p, momentum_buffer in zip(params, dp_list, momentum_buffer_list):
        if weight_decay != 0:
            if weight_decay_type == "grad":
                d_p.add_(p, alpha=weight_decay)
            elif weight_decay_type == "direct":
                p.mul_(1.0 - lr * weight_decay)
            else:
                raise ValueError("Invalid weight decay type provided")

        momentum_buffer.mul_(momentum).add_(d_p, alpha=1.0 - momentum)

        p.data.add_(momentum_buffer, alpha=-lr * nu)
        p.data.add_(d_p, alpha=-lr * (1.0 - nu))


class FunctionalQHM(torch.nn.Module):
    def __init__(self, weight_decay_type: str = "grad"):
        super().__init__()
        self.weight_decay_type = weight_decay_type

    @torch.jit.export
    def defaults(self) -> Dict[str, float]:
        return {"lr": 0.01, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.0}

    @torch.jit.export
    def check_options(self, options: Dict[str, float]) -> None:
        if options["lr"] < 0.0:
            raise ValueError("Invalid learning rate: {}".format(options["lr"]))
        if options["momentum"] < 0.0:
            raise ValueError("Invalid momentum value: {}".format(options["momentum"]))
        if options["weight_decay"] < 0.0:
            raise ValueError("Invalid weight_decay value: {}".format(options["weight_decay"]))

    @torch.jit.export
    def init_state(self, param: Tensor) -> Dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros_like(param)}

    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        qhm_update(params, grads, [state["momentum_buffer"] for state in states], options["lr"],
                   options["nu"], options["weight_decay"], self.weight_decay_type,
                   options["momentum"])
        return states

    def forward(self) -> None:  # a Module must have one; distoptim never calls it
        pass


if __name__ == "__main__":
    torch.jit.save(torch.jit.script(FunctionalQHM()), sys.argv[1])
