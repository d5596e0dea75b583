// RadixTree: match, insert, split, lock and LRU eviction, kept as small as SGLang's
// radix_cache.py. Page sharing is by reference count only; no KV is ever moved here.
#include "kvcache/radix_tree.h"

#include <algorithm>
#include <queue>
#include <string>

namespace treeserve {

RadixTree::RadixTree(PagePool* pool) : pool_(pool), scratch_refs_(pool->num_pages(), 0) {
  add_root(0);
}

RadixTree::~RadixTree() {
  // Return every page the cache holds. Nodes are torn down from an explicit stack: letting
  // the unique_ptrs recurse would take one stack frame per level of a deep (long-chain) tree.
  std::vector<std::unique_ptr<RadixNode>> doomed;
  for (auto& root : roots_) {
    for (auto& [token, child] : root->children) doomed.push_back(std::move(child));
    root->children.clear();
  }
  while (!doomed.empty()) {
    std::unique_ptr<RadixNode> n = std::move(doomed.back());
    doomed.pop_back();
    if (n->lock_ref > 0) pool_->add_locked(n->owner, -locked_pages(*n));
    for (int32_t page : n->pages) pool_->release(page);
    for (auto& [token, child] : n->children) doomed.push_back(std::move(child));
    n->children.clear();
  }
}

RadixNode* RadixTree::add_root(int32_t owner) {
  roots_.push_back(std::make_unique<RadixNode>());  // id 0: roots are never view runs
  roots_.back()->owner = owner;
  return roots_.back().get();
}

bool RadixTree::page_on_path(const RadixNode* node, int32_t position, int32_t page) const {
  const int32_t page_start = position / pool_->page_size() * pool_->page_size();
  if (page_start == position) return false;
  for (; node->parent != nullptr && node->end() > page_start; node = node->parent) {
    if (node->pages.back() == page) return true;
  }
  return false;
}

void RadixTree::remove_root(RadixNode* root) {
  assert(root != roots_[0].get() && root->parent == nullptr && root->children.empty());
  for (size_t i = 1; i < roots_.size(); ++i) {
    if (roots_[i].get() != root) continue;
    roots_[i] = std::move(roots_.back());
    roots_.pop_back();
    return;
  }
  assert(false && "remove_root of an unknown root");
}

int32_t RadixTree::pages_spanned(int32_t start, int32_t end) const {
  const int32_t ps = pool_->page_size();
  return end <= start ? 0 : (end - 1) / ps - start / ps + 1;
}

PrefixMatch RadixTree::match_prefix(std::span<const int32_t> tokens, int32_t max_length,
                                    const RadixNode* root) const {
  const RadixNode* cur = root != nullptr ? root : roots_[0].get();
  PrefixMatch m{const_cast<RadixNode*>(cur), 0, 0};
  const int32_t limit = std::min<int32_t>(max_length, static_cast<int32_t>(tokens.size()));
  while (m.length < limit) {
    auto it = cur->children.find(tokens[m.length]);
    if (it == cur->children.end()) break;
    const RadixNode* child = it->second.get();
    const int32_t n =
        std::min<int32_t>(static_cast<int32_t>(child->tokens.size()), limit - m.length);
    const int32_t* a = child->tokens.data();
    const int32_t* b = tokens.data() + m.length;
    const int32_t common = static_cast<int32_t>(std::mismatch(a, a + n, b).first - a);
    m.node = const_cast<RadixNode*>(child);
    m.node_tokens = common;
    m.length += common;
    if (common < static_cast<int32_t>(child->tokens.size())) break;
    cur = child;
  }
  return m;
}

RadixNode* RadixTree::node_at(const PrefixMatch& match) {
  RadixNode* n = match.node;
  if (n->parent == nullptr || match.node_tokens == static_cast<int32_t>(n->tokens.size())) {
    return n;
  }
  return split(n, match.node_tokens);
}

RadixNode* RadixTree::node_on_path(RadixNode* node, int32_t position) {
  // Stops at the root for position 0 (its end() is 0), else at the node holding position - 1.
  while (node->parent != nullptr && node->start >= position) node = node->parent;
  if (node->end() == position) return node;
  return split(node, position - node->start);
}

RadixNode* RadixTree::split(RadixNode* node, int32_t k) {
  assert(k > 0 && k < static_cast<int32_t>(node->tokens.size()));
  RadixNode* parent = node->parent;
  auto upper = std::make_unique<RadixNode>();
  upper->parent = parent;
  upper->start = node->start;
  upper->tokens.assign(node->tokens.begin(), node->tokens.begin() + k);
  upper->lock_ref = node->lock_ref;  // every lock through `node` passes through its upper half
  upper->last_access = node->last_access;
  upper->id = next_id_++;
  upper->owner = node->owner;
  // Locked pages stay the same: a page both halves list counts once, through the upper half.
  upper->shares_first_page = node->shares_first_page;
  const int32_t upper_pages = pages_spanned(upper->start, upper->end());
  upper->pages.assign(node->pages.begin(), node->pages.begin() + upper_pages);

  const int32_t ps = pool_->page_size();
  const int32_t mid = node->start + k;
  // The lower half's first page index is mid / ps; if mid is inside a page both keep it.
  const int32_t dropped = mid / ps - node->start / ps;
  if (mid % ps != 0) pool_->retain(node->pages[dropped]);
  node->shares_first_page = mid % ps != 0;
  node->pages.erase(node->pages.begin(), node->pages.begin() + dropped);
  const int32_t old_key = node->tokens[0];
  node->tokens.erase(node->tokens.begin(), node->tokens.begin() + k);
  node->start = mid;

  RadixNode* up = upper.get();
  std::unique_ptr<RadixNode> self = std::move(parent->children[old_key]);
  node->parent = up;
  up->children.emplace(node->tokens[0], std::move(self));
  parent->children[old_key] = std::move(upper);
  ++node_count_;
  return up;
}

RadixNode* RadixTree::insert(RadixNode* parent, std::span<const int32_t> tokens,
                             std::span<const int32_t> pages) {
  const int32_t ps = pool_->page_size();
  const int32_t page_base = parent->end() / ps;
  const int32_t total = static_cast<int32_t>(tokens.size());
  RadixNode* cur = parent;
  int32_t i = 0;
  const uint64_t now = ++clock_;
  while (i < total) {
    cur->last_access = now;
    auto it = cur->children.find(tokens[i]);
    if (it == cur->children.end()) {
      auto node = std::make_unique<RadixNode>();
      node->parent = cur;
      node->start = cur->end();
      node->tokens.assign(tokens.begin() + i, tokens.end());
      node->last_access = now;
      node->id = next_id_++;
      const int32_t first = node->start / ps - page_base;
      const int32_t count = pages_spanned(node->start, node->end());
      assert(first + count <= static_cast<int32_t>(pages.size()));
      node->pages.assign(pages.begin() + first, pages.begin() + first + count);
      for (int32_t page : node->pages) pool_->retain(page);
      node->owner = cur->owner;
      node->shares_first_page = page_on_path(cur, node->start, node->pages.front());
      cached_tokens_ += total - i;
      ++node_count_;
      RadixNode* raw = node.get();
      cur->children.emplace(tokens[i], std::move(node));
      return raw;
    }
    RadixNode* child = it->second.get();
    const int32_t n = std::min<int32_t>(static_cast<int32_t>(child->tokens.size()), total - i);
    const int32_t* a = child->tokens.data();
    const int32_t common =
        static_cast<int32_t>(std::mismatch(a, a + n, tokens.data() + i).first - a);
    if (common < static_cast<int32_t>(child->tokens.size())) child = split(child, common);
    cur = child;
    i += common;
  }
  cur->last_access = now;
  return cur;
}

void RadixTree::lock(RadixNode* node) {
  for (; node->parent != nullptr; node = node->parent) {
    if (node->lock_ref++ == 0) pool_->add_locked(node->owner, locked_pages(*node));
  }
}

void RadixTree::unlock(RadixNode* node, bool touch) {
  const uint64_t now = touch ? ++clock_ : 0;
  for (; node->parent != nullptr; node = node->parent) {
    assert(node->lock_ref > 0);
    if (--node->lock_ref == 0) pool_->add_locked(node->owner, -locked_pages(*node));
    if (touch) node->last_access = now;
  }
}

void RadixTree::unlock_node(RadixNode* node) {
  assert(node->parent != nullptr && node->lock_ref > 0);
  if (--node->lock_ref == 0) pool_->add_locked(node->owner, -locked_pages(*node));
}

void RadixTree::touch(RadixNode* node) {
  const uint64_t now = ++clock_;
  for (; node->parent != nullptr; node = node->parent) node->last_access = now;
}

void RadixTree::remove_leaf(RadixNode* leaf) {
  assert(leaf->children.empty() && leaf->lock_ref == 0 && leaf->parent != nullptr);
  for (int32_t page : leaf->pages) pool_->release(page);
  cached_tokens_ -= static_cast<int64_t>(leaf->tokens.size());
  --node_count_;
  leaf->parent->children.erase(leaf->tokens[0]);  // destroys leaf
}

bool RadixTree::evict(int32_t pages_needed, int32_t pages_wanted, const RadixNode* within) {
  if (pages_needed <= 0) return true;
  const int32_t target = std::max(pages_needed, pages_wanted);
  // Dry run first (LRU order, parents become candidates once their children are gone), so a
  // request that cannot be satisfied evicts nothing.
  using Entry = std::pair<uint64_t, RadixNode*>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  std::unordered_map<RadixNode*, int32_t> children_left;
  std::vector<RadixNode*> stack;
  push_roots(within, &stack);
  while (!stack.empty()) {
    RadixNode* n = stack.back();
    stack.pop_back();
    if (n->parent != nullptr && n->lock_ref == 0 && n->children.empty()) {
      heap.emplace(n->last_access, n);
    }
    for (auto& [token, child] : n->children) stack.push_back(child.get());
  }
  std::vector<RadixNode*> victims;
  std::vector<int32_t> touched;
  int32_t freed = 0;
  while (freed < target && !heap.empty()) {
    RadixNode* leaf = heap.top().second;
    heap.pop();
    victims.push_back(leaf);
    for (int32_t page : leaf->pages) {
      if (scratch_refs_[page]++ == 0) touched.push_back(page);
      if (pool_->ref_count(page) == scratch_refs_[page]) ++freed;
    }
    RadixNode* parent = leaf->parent;
    if (parent->parent == nullptr || parent->lock_ref > 0) continue;
    auto [it, inserted] =
        children_left.emplace(parent, static_cast<int32_t>(parent->children.size()));
    if (--it->second == 0) heap.emplace(parent->last_access, parent);
  }
  for (int32_t page : touched) scratch_refs_[page] = 0;
  if (freed < pages_needed) return false;
  for (RadixNode* leaf : victims) remove_leaf(leaf);
  return true;
}

int32_t RadixTree::evict_all(const RadixNode* within) {
  const int32_t before = pool_->num_free();
  // Every unlocked node goes: collect them, then remove children before parents.
  std::vector<RadixNode*> order;
  std::vector<RadixNode*> stack;
  push_roots(within, &stack);
  while (!stack.empty()) {
    RadixNode* n = stack.back();
    stack.pop_back();
    if (n->parent != nullptr && n->lock_ref == 0) order.push_back(n);
    for (auto& [token, child] : n->children) stack.push_back(child.get());
  }
  // Preorder reversed visits every child before its parent.
  for (auto it = order.rbegin(); it != order.rend(); ++it) remove_leaf(*it);
  return pool_->num_free() - before;
}

Status RadixTree::check_invariants() const {
  std::vector<const RadixNode*> stack;
  for (const auto& root : roots_) {
    if (root->parent != nullptr || !root->tokens.empty() || !root->pages.empty() ||
        root->lock_ref != 0) {
      return Internal("a radix root is not an empty root");
    }
    stack.push_back(root.get());
  }
  int64_t tokens = 0, nodes = 0;
  while (!stack.empty()) {
    const RadixNode* n = stack.back();
    stack.pop_back();
    int32_t child_locks = 0;
    for (const auto& [token, child] : n->children) {
      const std::string where = "radix node " + std::to_string(child->id);
      if (child->tokens.empty()) return Internal(where + " is empty");
      if (child->tokens[0] != token) return Internal(where + " filed under the wrong token");
      if (child->parent != n) return Internal(where + " has the wrong parent");
      if (child->owner != n->owner) return Internal(where + " has another owner than its parent");
      if (child->start != n->end()) return Internal(where + " starts at the wrong position");
      if (static_cast<int32_t>(child->pages.size()) != pages_spanned(child->start, child->end())) {
        return Internal(where + " lists the wrong number of pages");
      }
      for (int32_t page : child->pages) {
        if (page < 0 || page >= pool_->num_pages() || pool_->ref_count(page) <= 0) {
          return Internal(where + " lists a free or bad page");
        }
      }
      if (child->shares_first_page != page_on_path(n, child->start, child->pages.front())) {
        return Internal(where + " shares_first_page is wrong");
      }
      child_locks += child->lock_ref;
      tokens += static_cast<int64_t>(child->tokens.size());
      ++nodes;
      stack.push_back(child.get());
    }
    if (n->parent != nullptr && n->lock_ref < child_locks) {
      return Internal("radix node " + std::to_string(n->id) + " lock_ref below its children's");
    }
  }
  if (tokens != cached_tokens_) return Internal("cached_tokens counter out of sync");
  if (nodes != node_count_) return Internal("node_count counter out of sync");
  return Status::Ok();
}

}  // namespace treeserve
