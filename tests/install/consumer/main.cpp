// Uses an installed distoptim: creates SGD through the registry, runs one step and checks that
// the parameter moved by -lr * gradient. Exits non-zero on any mismatch or exception.

#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include <distoptim/optim.h>

int main() {
  try {
    namespace optim = distoptim::optim;
    // Values and lr are exact binary fractions, so the expected result is exact too.
    const std::vector<float> start = {1.0f, -2.0f, 3.5f, 0.0f};
    const std::vector<float> gradient = {0.5f, 0.25f, -1.0f, 2.0f};
    const double lr = 0.5;
    at::Tensor param = at::tensor(start);
    const at::Tensor grad = at::tensor(gradient);

    std::unique_ptr<optim::FunctionalOptimizer> sgd = optim::create_optimizer(
        "sgd", {optim::ParamGroup({param})}, optim::OptionBag().set("lr", lr));
    sgd->step({grad});

    int failures = 0;
    const float* p = param.data_ptr<float>();
    for (size_t i = 0; i < start.size(); ++i) {
      const float expected = start[i] - static_cast<float>(lr) * gradient[i];
      if (p[i] != expected) {
        std::fprintf(stderr, "param[%zu] = %g after one SGD step, expected %g\n", i, p[i],
                     expected);
        ++failures;
      }
    }
    if (sgd->name() != "sgd") {
      std::fprintf(stderr, "optimizer name is '%s', expected 'sgd'\n", sgd->name().c_str());
      ++failures;
    }
    if (failures != 0) return 1;
    std::printf("distoptim consumer: one SGD step OK\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distoptim consumer: exception: %s\n", e.what());
    return 1;
  }
}
