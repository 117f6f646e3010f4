"""Reference for tests/dist_optim/torchscript_optimizer_test.cpp: TorchScript optimizers saved
with torch.jit.save as the recipe says (examples/custom_qhm/qhm_torchscript.py, docs/optim.md),
broken ones for the errors, and PyTorch 1.13's run of the good ones.

Usage: torchscript_reference.py --out DIR

Writes into DIR (tensor lists with torch.save; every list holds at least two items):
  qhm.pt                the seed's QHM (the recipe's script, imported from examples/custom_qhm)
  adam2.pt              an optimizer with two state tensors per parameter (Adam's moments, bias
                        corrected with the step counts)
  seed_uncorrected.pt   the seed's qhm_update as the seed wrote it (add_(scalar, tensor))
  no_update.pt, wrong_signature.pt, drops_state.pt, wrong_shape.pt, refuses.pt
                        scripts that break the recipe, one way each
  not_archive.pt        a tensor saved with torch.save (not a TorchScript archive)
  params.pt             the initial parameters (float32, three of them)
  grads.pt              the gradients of STEPS steps, step-major; an empty tensor: no gradient
  <case>_result.pt      for qhm and adam2: PyTorch's run of the loaded script over those steps
                        (init_state at a parameter's first gradient, update with the parameters
                        that have one, under no_grad): the final parameters, then each
                        parameter's state tensors in init_state's order
  errors.txt            PyTorch's error stepping seed_uncorrected.pt: the line of its traceback of
                        the original code that names the source file and line, then the error's
                        last line
"""

import argparse
import os
import sys
from typing import Dict, List

import torch
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                                "custom_qhm"))
import qhm_torchscript  # noqa: E402

STEPS = 6
SEED = 11
OPTIONS = {"qhm": {"lr": 0.05, "momentum": 0.8, "nu": 0.6, "weight_decay": 0.01},
           "adam2": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}}


class Adam2(torch.nn.Module):
    @torch.jit.export
    def defaults(self) -> Dict[str, float]:
        return {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

    @torch.jit.export
    def init_state(self, param: Tensor) -> Dict[str, Tensor]:
        return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        beta1, beta2 = options["beta1"], options["beta2"]
        for p, g, state, step in zip(params, grads, states, steps):
            exp_avg = state["exp_avg"].mul(beta1).add(g, alpha=1.0 - beta1)
            exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(g, g, value=1.0 - beta2)
            bias1 = 1.0 - beta1 ** step
            bias2 = 1.0 - beta2 ** step
            denom = (exp_avg_sq / bias2).sqrt().add_(options["eps"])
            p.addcdiv_(exp_avg, denom, value=-options["lr"] / bias1)
            state["exp_avg"] = exp_avg  # new tensors, returned: the state is what update returns
            state["exp_avg_sq"] = exp_avg_sq
        return states

    def forward(self) -> None:
        pass


def seed_qhm_update(params: List[Tensor], dp_list: List[Tensor],
                    momentum_buffer_list: List[Tensor], lr: float, nu: float,
                    weight_decay: float, weight_decay_type: str, momentum: float):
    for p, d_p, momentum_buffer in zip(params, dp_list, momentum_buffer_list):
        if weight_decay != 0:
            if weight_decay_type == "grad":
                d_p.add_(weight_decay, p)
            elif weight_decay_type == "direct":
                p.mul_(1.0 - lr * weight_decay)
            else:
                raise ValueError("Invalid weight decay type provided")

        momentum_buffer.mul_(momentum).add_(1.0 - momentum, d_p)

        p.data.add_(-lr * nu, momentum_buffer)
        p.data.add_(-lr * (1.0 - nu), d_p)


class SeedUncorrected(qhm_torchscript.FunctionalQHM):
    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        seed_qhm_update(params, grads, [state["momentum_buffer"] for state in states],
                        options["lr"], options["nu"], options["weight_decay"],
                        self.weight_decay_type, options["momentum"])
        return states


class NoUpdate(torch.nn.Module):
    @torch.jit.export
    def defaults(self) -> Dict[str, float]:
        return {"lr": 0.1}

    @torch.jit.export
    def init_state(self, param: Tensor) -> Dict[str, Tensor]:
        return {"buf": torch.zeros_like(param)}

    def forward(self) -> None:
        pass


class WrongSignature(NoUpdate):
    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], lr: float) -> None:
        for p, g in zip(params, grads):
            p.add_(g, alpha=-lr)


class DropsState(NoUpdate):
    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        out: List[Dict[str, Tensor]] = []
        for p, g in zip(params, grads):
            p.add_(g, alpha=-options["lr"])
            out.append({"other": g})
        return out


class WrongShape(NoUpdate):
    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        return [{"buf": torch.zeros(1)} for _ in params]


class Refuses(NoUpdate):
    @torch.jit.export
    def check_options(self, options: Dict[str, float]) -> None:
        if options["lr"] > 1.0:
            raise ValueError("lr above 1 is refused here")

    @torch.jit.export
    def update(self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]],
               steps: List[int], options: Dict[str, float]) -> List[Dict[str, Tensor]]:
        for p, g in zip(params, grads):
            p.add_(g, alpha=-options["lr"])
        return states


def save_list(tensors, path):
    # LibTorch 1.13's unpickler lacks the opcodes Python uses for one-element lists.
    assert len(tensors) >= 2, path
    torch.save(list(tensors), path)


def run(script_path, params, grads, options):
    """PyTorch's run of a saved optimizer: the protocol distoptim follows."""
    script = torch.jit.load(script_path)
    params = [p.clone() for p in params]
    # The seed's QHM adds the weight decay into its gradients: each run gets its own.
    grads = [[None if g is None else g.clone() for g in step] for step in grads]
    states: List[Dict[str, Tensor]] = [{} for _ in params]
    steps = [0] * len(params)
    for step_grads in grads:
        indices = [i for i, g in enumerate(step_grads) if g is not None]
        for i in indices:
            if not states[i]:
                states[i] = script.init_state(params[i])
            steps[i] += 1
        with torch.no_grad():
            after = script.update([params[i] for i in indices], [step_grads[i] for i in indices],
                                  [states[i] for i in indices], [steps[i] for i in indices],
                                  options)
        for i, state in zip(indices, after):
            states[i] = state
    out = list(params)
    for state in states:
        out.extend(state.values())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    scripts = {"qhm": qhm_torchscript.FunctionalQHM(), "adam2": Adam2(),
               "seed_uncorrected": SeedUncorrected(), "no_update": NoUpdate(),
               "wrong_signature": WrongSignature(), "drops_state": DropsState(),
               "wrong_shape": WrongShape(), "refuses": Refuses()}
    for name, module in scripts.items():
        torch.jit.save(torch.jit.script(module), os.path.join(out, name + ".pt"))
    torch.save(torch.ones(2), os.path.join(out, "not_archive.pt"))

    torch.manual_seed(SEED)
    params = [torch.randn(6, 5), torch.randn(33), torch.randn(4, 4)]
    grads = []
    for step in range(STEPS):
        # Parameter 1 has no gradient in steps 0 and 3.
        grads.append([None if (i == 1 and step % 3 == 0) else torch.randn(p.shape)
                      for i, p in enumerate(params)])
    save_list(params, os.path.join(out, "params.pt"))
    save_list([torch.empty(0) if g is None else g for step in grads for g in step],
              os.path.join(out, "grads.pt"))
    for case in ("qhm", "adam2"):
        save_list(run(os.path.join(out, case + ".pt"), params, grads, OPTIONS[case]),
                  os.path.join(out, case + "_result.pt"))

    try:
        run(os.path.join(out, "seed_uncorrected.pt"), params, grads, OPTIONS["qhm"])
        lines = ["no error", "no error"]
    except RuntimeError as error:
        text = str(error).splitlines()
        # The traceback of the original code names the script's source file and line.
        lines = [[line.strip() for line in text if line.strip().startswith("File ")][-1],
                 text[-1].strip()]
    with open(os.path.join(out, "errors.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
