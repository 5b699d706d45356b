// Loading user kernels with the xmix_custom_args ABI from shared libraries (CPU side).
#include <dlfcn.h>

#include <string>

#include "xmix/control.h"
#include "xmix/custom.h"

namespace xmix {

// Returns the function pointer, or 0 with `error` set. The library stays loaded for the
// process's life: a deployed op may be re-enabled at any step.
uint64_t load_custom_cpu(const std::string& library, const std::string& symbol,
                         std::string* error) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    *error = std::string("cannot load custom kernel library '") + library + "': " + dlerror();
    return 0;
  }
  dlerror();
  void* fn = dlsym(handle, symbol.c_str());
  if (const char* err = dlerror()) {
    *error = std::string("symbol '") + symbol + "' not found in '" + library + "': " + err;
    return 0;
  }
  return addr(fn);
}

}  // namespace xmix
