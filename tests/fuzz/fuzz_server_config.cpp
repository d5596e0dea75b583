// Fuzzes the server's JSON config (server/config.h): merge_config_json onto the defaults, then
// validate_config. Refusals are INVALID_ARGUMENT naming the source; an accepted config prints
// (config_to_json) as JSON that merges back into the same config, whatever it holds.
#include <cstdint>
#include <string>

#include "server/config.h"
#include "tests/fuzz/fuzz_util.h"

using treeserve::fuzz::check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  treeserve::TreeserveConfig config;
  treeserve::Status merged = treeserve::merge_config_json(text, "fuzz.json", &config);
  if (!merged.ok()) {
    check(merged.code() == treeserve::StatusCode::kInvalidArgument,
          "a bad config is INVALID_ARGUMENT");
    check(merged.message().rfind("fuzz.json", 0) == 0, "the message names the file first");
    return 0;
  }
  treeserve::Status valid = treeserve::validate_config(config);
  check(valid.ok() ||
            (valid.code() == treeserve::StatusCode::kInvalidArgument && !valid.message().empty()),
        "an invalid config is INVALID_ARGUMENT with a message");

  // The effective config (what the server logs) reads back as the same config. The token is
  // printed masked, so it is compared masked.
  const std::string printed = treeserve::config_to_json(config);
  treeserve::TreeserveConfig again;
  treeserve::Status reread = treeserve::merge_config_json(printed, "printed", &again);
  check(reread.ok(), "config_to_json prints a config merge_config_json reads");
  if (!config.server.auth_token.empty()) again.server.auth_token = config.server.auth_token;
  check(treeserve::config_to_json(again) == printed, "the printed config reads back the same");
  check(treeserve::validate_config(again).ok() == valid.ok(), "and validates the same");
  return 0;
}
