// validate() of every built-in options struct. The rules are PyTorch 1.13's constructor checks
// (torch/optim/<name>.py), reported as "<Optimizer> option <key> = <value>: <rule>".
#include <distoptim/optim/adadelta.h>
#include <distoptim/optim/adagrad.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/adamax.h>
#include <distoptim/optim/rmsprop.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/optim/sparse_adam.h>

#include <c10/util/Exception.h>

namespace distoptim {
namespace optim {

namespace {

void require(bool ok, const char* optimizer, const char* key, double value, const char* rule) {
  TORCH_CHECK_VALUE(ok, optimizer, " option ", key, " = ", value, ": must be ", rule);
}

void require_pair(bool ok, const char* optimizer, const char* key,
                  const std::tuple<double, double>& value, const char* rule) {
  TORCH_CHECK_VALUE(ok, optimizer, " option ", key, " = (", std::get<0>(value), ", ",
                    std::get<1>(value), "): must be ", rule);
}

void require_betas(const char* optimizer, const std::tuple<double, double>& betas) {
  const double b1 = std::get<0>(betas);
  const double b2 = std::get<1>(betas);
  require_pair(0.0 <= b1 && b1 < 1.0 && 0.0 <= b2 && b2 < 1.0, optimizer, "betas", betas,
               "in [0, 1) each");
}

void require_non_negative(const char* optimizer, const char* key, double value) {
  require(value >= 0.0, optimizer, key, value, ">= 0");
}

template <class Options>
void validate_adam_like(const char* optimizer, const Options& o) {
  require_non_negative(optimizer, "lr", o.lr());
  require_non_negative(optimizer, "eps", o.eps());
  require_betas(optimizer, o.betas());
  require_non_negative(optimizer, "weight_decay", o.weight_decay());
}

}  // namespace

void SGDOptions::validate() const {
  require_non_negative("SGD", "lr", lr());
  require_non_negative("SGD", "momentum", momentum());
  require_non_negative("SGD", "weight_decay", weight_decay());
  TORCH_CHECK_VALUE(!nesterov() || (momentum() > 0 && dampening() == 0),
                    "SGD option nesterov = true requires momentum > 0 and dampening = 0 (got "
                    "momentum = ",
                    momentum(), ", dampening = ", dampening(), ")");
}

void AdamOptions::validate() const { validate_adam_like("Adam", *this); }

void SparseAdamOptions::validate() const {
  require(lr() > 0.0, "SparseAdam", "lr", lr(), "> 0");
  require(eps() > 0.0, "SparseAdam", "eps", eps(), "> 0");
  require_betas("SparseAdam", betas());
}

void AdamWOptions::validate() const { validate_adam_like("AdamW", *this); }

void AdagradOptions::validate() const {
  require_non_negative("Adagrad", "lr", lr());
  require_non_negative("Adagrad", "lr_decay", lr_decay());
  require_non_negative("Adagrad", "weight_decay", weight_decay());
  require_non_negative("Adagrad", "initial_accumulator_value", initial_accumulator_value());
  require_non_negative("Adagrad", "eps", eps());
}

void AdadeltaOptions::validate() const {
  require_non_negative("Adadelta", "lr", lr());
  require(0.0 <= rho() && rho() <= 1.0, "Adadelta", "rho", rho(), "in [0, 1]");
  require_non_negative("Adadelta", "eps", eps());
  require_non_negative("Adadelta", "weight_decay", weight_decay());
}

void AdamaxOptions::validate() const { validate_adam_like("Adamax", *this); }

void RMSpropOptions::validate() const {
  require_non_negative("RMSprop", "lr", lr());
  require_non_negative("RMSprop", "eps", eps());
  require_non_negative("RMSprop", "momentum", momentum());
  require_non_negative("RMSprop", "weight_decay", weight_decay());
  require_non_negative("RMSprop", "alpha", alpha());
}

void RpropOptions::validate() const {
  require_non_negative("Rprop", "lr", lr());
  const double minus = std::get<0>(etas());
  const double plus = std::get<1>(etas());
  require_pair(0.0 < minus && minus < 1.0 && 1.0 < plus, "Rprop", "etas", etas(),
               "(etaminus, etaplus) with 0 < etaminus < 1 < etaplus");
  const double lo = std::get<0>(step_sizes());
  const double hi = std::get<1>(step_sizes());
  require_pair(0.0 <= lo && lo <= hi, "Rprop", "step_sizes", step_sizes(),
               "(min, max) with 0 <= min <= max");
}

}  // namespace optim
}  // namespace distoptim
