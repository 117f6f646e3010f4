#include "future_errors.h"

namespace distoptim {
namespace rpc {
namespace detail {

std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const RemoteError& remote) {
    return remote.remote_message();
  } catch (const c10::Error& c10_error) {
    return c10_error.what_without_backtrace();
  } catch (const std::exception& other) {
    return other.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
