#include <distoptim/data_parallel/gradient_store.h>

#include <mutex>
#include <utility>

namespace distoptim {
namespace data_parallel {

namespace {

struct ProviderSlot {
  std::mutex mutex;
  std::shared_ptr<const GradientStoreProvider> provider;  // guarded by mutex
};

ProviderSlot& slot() {
  static ProviderSlot* const kInstance = new ProviderSlot();  // never destroyed: used at exit
  return *kInstance;
}

}  // namespace

void set_gradient_store_provider(GradientStoreProvider provider) {
  auto installed =
      provider ? std::make_shared<const GradientStoreProvider>(std::move(provider)) : nullptr;
  std::lock_guard<std::mutex> lock(slot().mutex);
  slot().provider = std::move(installed);
}

std::shared_ptr<GradientStore> current_gradient_store() {
  std::shared_ptr<const GradientStoreProvider> provider;
  {
    std::lock_guard<std::mutex> lock(slot().mutex);
    provider = slot().provider;
  }
  // Called without the lock: a provider may take locks of its own.
  return provider ? (*provider)() : nullptr;
}

bool has_gradient_store_provider() {
  std::lock_guard<std::mutex> lock(slot().mutex);
  return slot().provider != nullptr;
}

}  // namespace data_parallel
}  // namespace distoptim
