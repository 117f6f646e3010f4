"""Reference for the custom QHM optimizer example: the update formula of the TorchScript
distributed-optimizer recipe (qhm_update), run with PyTorch on the inputs the C++ test wrote.

Usage: qhm_reference.py INPUT OUTPUT. INPUT holds params, grads (one list per step, None where a
parameter has no gradient) and options; OUTPUT receives the final params and momentum buffers.
The momentum buffer persists across steps (the recipe's FunctionalQHM zeroes it every step,
which is a bug in the recipe, not part of the formula)."""
import sys

import torch


def qhm_update(params, dp_list, momentum_buffer_list, lr, nu, weight_decay, weight_decay_type,
               momentum):
    # The recipe's formula, with its in-place gradient update made out-of-place and the
    # deprecated add_(scalar, tensor) overload spelled with alpha=.
    for p, d_p, momentum_buffer in zip(params, dp_list, momentum_buffer_list):
        if weight_decay != 0:
            if weight_decay_type == "grad":
                d_p = d_p.add(p, alpha=weight_decay)
            elif weight_decay_type == "direct":
                p.mul_(1.0 - lr * weight_decay)
            else:
                raise ValueError("Invalid weight decay type provided")
        momentum_buffer.mul_(momentum).add_(d_p, alpha=1.0 - momentum)
        p.data.add_(momentum_buffer, alpha=-lr * nu)
        p.data.add_(d_p, alpha=-lr * (1.0 - nu))


def main():
    data = torch.load(sys.argv[1])
    params = [p.clone() for p in data["params"]]
    o = data["options"]
    buffers = [None] * len(params)
    for step_grads in data["grads"]:
        ps, gs, bs = [], [], []
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            if buffers[i] is None:
                buffers[i] = torch.zeros_like(params[i])
            ps.append(params[i])
            gs.append(g)
            bs.append(buffers[i])
        with torch.no_grad():
            qhm_update(ps, gs, bs, o["lr"], o["nu"], o["weight_decay"], o["weight_decay_type"],
                       o["momentum"])
    torch.save({"params": params, "buffers": buffers}, sys.argv[2])


if __name__ == "__main__":
    main()
