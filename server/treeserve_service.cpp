// TreeServe method bodies. Tree operations are served by the scheduler (issue 7); until it
// lands they answer UNIMPLEMENTED with a message saying so.
#include "server/treeserve_service.h"

#include <spdlog/spdlog.h>

#include "models/tokenizer.h"
#include "server/grpc_status.h"

namespace treeserve {

namespace {
grpc::Status not_yet(const char* method) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      std::string(method) +
                          " is not implemented yet in this build of treeserve (tree operations "
                          "arrive with the scheduler)");
}
}  // namespace

TreeServeService::TreeServeService(const TreeserveConfig& config, const Tokenizer* tokenizer,
                                   ServingInfo info)
    : config_(config), tokenizer_(tokenizer), info_(std::move(info)) {}

grpc::Status TreeServeService::check_auth(const grpc::ServerContext* context) const {
  if (config_.server.auth_token.empty()) return grpc::Status::OK;
  const auto& md = context->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing authorization metadata (expected 'Bearer <token>')");
  }
  std::string value(it->second.data(), it->second.size());
  if (value != "Bearer " + config_.server.auth_token) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid auth token");
  }
  return grpc::Status::OK;
}

grpc::Status TreeServeService::CreateTree(grpc::ServerContext* ctx, const v1::CreateTreeRequest*,
                                          v1::CreateTreeResponse*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("CreateTree");
}

grpc::Status TreeServeService::Branch(grpc::ServerContext* ctx, const v1::BranchRequest*,
                                      v1::BranchResponse*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("Branch");
}

grpc::Status TreeServeService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest*,
                                        grpc::ServerWriter<v1::GenerateResponse>*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("Generate");
}

grpc::Status TreeServeService::Prune(grpc::ServerContext* ctx, const v1::PruneRequest*,
                                     v1::PruneResponse*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("Prune");
}

grpc::Status TreeServeService::Verify(grpc::ServerContext* ctx, const v1::VerifyRequest*,
                                      v1::VerifyResponse*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("Verify");
}

grpc::Status TreeServeService::GetTree(grpc::ServerContext* ctx, const v1::GetTreeRequest*,
                                       v1::TreeInfo*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("GetTree");
}

grpc::Status TreeServeService::DeleteTree(grpc::ServerContext* ctx, const v1::DeleteTreeRequest*,
                                          v1::DeleteTreeResponse*) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  return not_yet("DeleteTree");
}

grpc::Status TreeServeService::Tokenize(grpc::ServerContext* ctx,
                                        const v1::TokenizeRequest* request,
                                        v1::TokenizeResponse* response) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  if (request->text().empty()) return grpc_invalid("text: must not be empty");
  auto ids = tokenizer_->encode(request->text());
  if (!ids.ok()) return to_grpc(ids.status());
  response->mutable_ids()->Add(ids->begin(), ids->end());
  return grpc::Status::OK;
}

grpc::Status TreeServeService::Detokenize(grpc::ServerContext* ctx,
                                          const v1::DetokenizeRequest* request,
                                          v1::DetokenizeResponse* response) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  const int32_t vocab = tokenizer_->vocab_size();
  std::vector<int32_t> ids(request->ids().begin(), request->ids().end());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return grpc_invalid("ids[" + std::to_string(i) + "]: token id " + std::to_string(ids[i]) +
                          " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  auto text = tokenizer_->decode(ids);
  if (!text.ok()) return to_grpc(text.status());
  response->set_text(*text);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::GetServerInfo(grpc::ServerContext* ctx,
                                             const v1::GetServerInfoRequest*,
                                             v1::ServerInfo* response) {
  if (auto s = check_auth(ctx); !s.ok()) return s;
  response->set_model(info_.model_name);
  response->set_backend(info_.backend);
  response->set_tensor_parallel(info_.tensor_parallel);
  response->set_page_size(info_.page_size);
  response->set_kv_pages_total(info_.kv_pages_total);
  response->set_kv_pages_free(info_.kv_pages_total);
  response->set_radix_cached_tokens(0);
  response->set_live_trees(0);
  response->set_live_branches(0);
  return grpc::Status::OK;
}

}  // namespace treeserve
