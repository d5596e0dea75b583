// QuantConfig's names and the KV cache dtype option (models/quantization.h).
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

StatusOr<KvCacheDtype> parse_kv_cache_dtype(const std::string& value, const std::string& option) {
  if (value == "auto") return KvCacheDtype::kAuto;
  if (value == "fp8" || value == "fp8_e4m3") return KvCacheDtype::kFp8E4m3;
  if (value == "fp8_e5m2") {
    return InvalidArgument(option +
                           " 'fp8_e5m2' is not supported: only e4m3 is (fp8 or fp8_e4m3, "
                           "with one float32 scale per token and kv head)");
  }
  // The value as given, cut to 64 bytes (it comes from a file or the command line).
  const std::string shown = value.size() > 64 ? value.substr(0, 64) + "..." : value;
  return InvalidArgument(option + " must be auto, fp8 or fp8_e4m3, got '" + shown + "'");
}

const char* kv_cache_dtype_name(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::kAuto:
      return "auto";
    case KvCacheDtype::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "?";
}

}  // namespace treeserve
