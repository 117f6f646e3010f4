// LibTorch adapter: being written.
