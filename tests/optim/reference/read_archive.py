"""Reads an archive that torch::save(optimizer, path) wrote in C++ (a ZeroRedundancyOptimizer, a
DistributedOptimizer or an optimizer adapter) as a Python user would: with torch.load. LibTorch's
OutputArchive is a TorchScript module, so torch.load hands the file to torch.jit.load (with a
UserWarning saying so) and returns a ScriptModule; the state dict is its attribute KEY.

Checks that torch.load took that path and that what it read is a state dict made of Python values
(dicts, lists, strings, numbers, tensors), prints a summary, and saves the dict with torch.save to
OUT as plain Python data, for the C++ test to compare with what it wrote (with a pickler that
LibTorch's unpickler can read, see _Pickler).

Usage: read_archive.py ARCHIVE KEY OUT
"""

import pickle
import sys
import types
import warnings

import torch


class _Pickler(pickle._Pickler):
    """Python's pickler, but a list or dict of one item is written as of several (MARK, item,
    APPENDS / SETITEMS): LibTorch 1.13's unpickler (torch::pickle_load) does not know the APPEND
    opcode Python uses for a list of one item ("Unknown opcode for unpickling at 0x61")."""

    def _batch_appends(self, items):
        items = list(items)
        if items:  # nothing for none, as Python's
            self.write(pickle.MARK)
            for item in items:
                self.save(item)
            self.write(pickle.APPENDS)

    def _batch_setitems(self, items):
        items = list(items)
        if items:
            self.write(pickle.MARK)
            for key, value in items:
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)


# torch.save(obj, f, pickle_module=...) takes its Pickler from here.
_PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="read_archive_pickle")


def walk(value, path, leaves):
    """Every leaf of `value` by path; fails on a value that is not plain Python data."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, (str, int)), "{}: key {!r} of type {}".format(path, key, type(key))
            walk(item, "{}[{!r}]".format(path, key), leaves)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            walk(item, "{}[{}]".format(path, i), leaves)
    else:
        assert isinstance(value, (torch.Tensor, str, int, float, bool)) or value is None, \
            "{}: a {} (not plain data)".format(path, type(value))
        leaves.append((path, value))


def main():
    archive, key, out = sys.argv[1:4]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = torch.load(archive)
    assert isinstance(module, torch.jit.ScriptModule), \
        "torch.load returned a {}, not a ScriptModule".format(type(module))
    assert any("torch.jit.load" in str(w.message) for w in caught), \
        "torch.load did not say it dispatched to torch.jit.load: {}".format(
            [str(w.message) for w in caught])
    assert hasattr(module, key), "the archive has no attribute {!r}; it has {}".format(
        key, [name for name, _ in module._c._get_attributes()] if hasattr(module._c, "_get_attributes") else "?")
    state_dict = getattr(module, key)
    assert isinstance(state_dict, dict), "{} is a {}, not a dict".format(key, type(state_dict))
    leaves = []
    walk(state_dict, key, leaves)
    tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
    print("read_archive.py: {}: {} values, {} tensors ({} elements)".format(
        archive, len(leaves), len(tensors), sum(t.numel() for t in tensors)))
    torch.save(state_dict, out, pickle_module=_PICKLE_MODULE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
