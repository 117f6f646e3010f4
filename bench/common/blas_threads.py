"""What the PyTorch sides of the benchmarks report about the BLAS they run on."""

import ctypes


def blas_threads():
    """The threads of the OpenBLAS this process loaded (torch calls the system BLAS, and
    torch.set_num_threads does not reach it), or -1 where the BLAS is another."""
    # torch's libraries are loaded RTLD_LOCAL: open the loaded BLAS by its path instead.
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "blas" in line and "/" in line}
    for path in sorted(paths):
        function = getattr(ctypes.CDLL(path), "openblas_get_num_threads", None)
        if function is not None:
            return function()
    return -1
