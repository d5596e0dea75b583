// QuantConfig's names (models/quantization.h).
#include "models/quantization.h"

namespace treeserve {

const char* quant_scheme_name(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kNone:
      return "none";
    case QuantScheme::kFp8:
      return "fp8";
  }
  return "?";
}

}  // namespace treeserve
