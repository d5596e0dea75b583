// The treeserve process: command line -> effective config -> model, tokenizer, KV capacity
// -> gRPC server, until SIGTERM/SIGINT shuts it down gracefully.
#pragma once

namespace treeserve {

// Returns the process exit code: 0 after a clean shutdown, 1 on a start-up error (which is
// logged with a message naming the bad flag, file or field), 2 on a command-line error.
int run_treeserve(int argc, char** argv);

}  // namespace treeserve
