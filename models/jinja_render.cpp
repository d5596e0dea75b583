// Rendering a Jinja syntax tree (models/detail/jinja.h). Scopes follow Jinja: each for-loop
// iteration and each macro call gets its own frame, so a `set` inside them does not outlive
// them (templates carry state out of loops in a namespace()); `if` makes no frame. Macros see
// the template's top-level variables and their own parameters.
#include <cmath>
#include <unordered_map>

#include "models/detail/jinja.h"
#include "models/detail/unicode.h"

namespace treeserve::jinja {

struct Renderer::Frame {
  Frame* parent = nullptr;
  std::unordered_map<std::string, Value> vars;

  const Value* find(const std::string& name) const {
    for (const Frame* f = this; f != nullptr; f = f->parent) {
      auto it = f->vars.find(name);
      if (it != f->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

namespace {

constexpr int kMaxMacroDepth = 64;

[[noreturn]] void fail_line(int line, const std::string& what) {
  throw TemplateError("line " + std::to_string(line) + ": " + what);
}

std::string object_name(const Value& obj) {
  if (obj.is_undefined()) return obj.hint();
  std::string name = "'";  // appended, not `"'" + ...`: GCC 12 -Wrestrict false positive
  name += obj.type_name();
  name += " object'";
  return name;
}

// Python's index rules: negative counts from the end; outside the sequence: -1.
int64_t resolve_index(int64_t index, size_t size) {
  if (index < 0) index += int64_t(size);
  return index < 0 || index >= int64_t(size) ? -1 : index;
}

// Python's slice.indices(): the positions a[start:stop:step] visits.
std::vector<size_t> slice_positions(const Value* start, const Value* stop, const Value* step,
                                    size_t size) {
  auto part = [](const Value* v, const char* what) -> std::optional<int64_t> {
    if (v == nullptr || v->is_none()) return std::nullopt;
    if (!v->is_integral())
      throw TemplateError(std::string("slice ") + what + " must be an integer");
    return v->as_int();
  };
  const int64_t n = int64_t(size);
  const int64_t s = part(step, "step").value_or(1);
  if (s == 0) throw TemplateError("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    if (s > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t begin = clamp(part(start, "start"), s > 0 ? 0 : n - 1);
  const int64_t end = clamp(part(stop, "stop"), s > 0 ? n : -1);
  std::vector<size_t> out;
  for (int64_t i = begin; s > 0 ? i < end : i > end; i += s) out.push_back(size_t(i));
  return out;
}

Value number_result(double f, bool integral, int64_t i) {
  return integral ? Value::integer(i) : Value::number(f);
}

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) throw TemplateError(a.hint());
  if (b.is_undefined()) throw TemplateError(b.hint());
  throw TemplateError("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, Renderer* r) {
  if (op == "~") {
    std::string s = a.str() + b.str();
    r->check_size(s.size());
    return Value::string(std::move(s));
  }
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    const int64_t x = a.as_int(), y = b.as_int();
    const double fx = a.as_double(), fy = b.as_double();
    if (op == "+") return number_result(fx + fy, ints, x + y);
    if (op == "-") return number_result(fx - fy, ints, x - y);
    if (op == "*") return number_result(fx * fy, ints, x * y);
    if (op == "/") {
      if (fy == 0.0) throw TemplateError("division by zero");
      return Value::number(fx / fy);
    }
    if (op == "//" || op == "%") {
      if (fy == 0.0) throw TemplateError(op == "%" ? "modulo by zero" : "division by zero");
      if (ints) return Value::integer(op == "//" ? floor_div(x, y) : x - floor_div(x, y) * y);
      const double q = std::floor(fx / fy);
      return Value::number(op == "//" ? q : fx - q * fy);
    }
    if (op == "**") {
      if (ints && y >= 0) {
        int64_t p = 1;
        for (int64_t k = 0; k < y; ++k) p *= x;
        return Value::integer(p);
      }
      return Value::number(std::pow(fx, fy));
    }
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    r->check_size(a.as_string().size() + b.as_string().size());
    return Value::string(a.as_string() + b.as_string());
  }
  if (op == "+" && a.is_list() && b.is_list()) {
    List items = a.as_list();
    items.insert(items.end(), b.as_list().begin(), b.as_list().end());
    return Value::list(std::move(items));
  }
  if (op == "*" && ((a.is_string() || a.is_list()) && b.is_integral())) {
    return arithmetic(op, b, a, r);
  }
  if (op == "*" && a.is_integral() && (b.is_string() || b.is_list())) {
    const int64_t n = std::max<int64_t>(a.as_int(), 0);
    if (b.is_string()) {
      r->check_size(size_t(n) * b.as_string().size());
      std::string s;
      for (int64_t k = 0; k < n; ++k) s += b.as_string();
      return Value::string(std::move(s));
    }
    r->check_size(size_t(n) * b.as_list().size());
    List items;
    for (int64_t k = 0; k < n; ++k)
      items.insert(items.end(), b.as_list().begin(), b.as_list().end());
    return Value::list(std::move(items));
  }
  unsupported(op, a, b);
}

// Binds loop or set targets: one name takes the value, several unpack it (`for k, v in ...`,
// `set a, b = ...`).
void assign(const std::vector<std::string>& targets, const Value& value,
            std::unordered_map<std::string, Value>* vars) {
  if (targets.size() == 1) {
    (*vars)[targets[0]] = value;
    return;
  }
  List parts = value.iterate();
  if (parts.size() != targets.size()) {
    throw TemplateError("cannot unpack " + std::to_string(parts.size()) + " values into " +
                        std::to_string(targets.size()) + " names");
  }
  for (size_t k = 0; k < parts.size(); ++k) (*vars)[targets[k]] = parts[k];
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        throw TemplateError("'in <string>' requires string as left operand, not " +
                            item.type_name());
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : container.as_list()) {
        if (equal(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      throw TemplateError("argument of type '" + container.type_name() + "' is not iterable");
  }
}

}  // namespace

Value get_attribute(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) throw TemplateError(obj.hint());
  if (obj.is_dict() && obj.as_dict().is_namespace) {
    if (const Value* v = obj.as_dict().find(name)) return *v;
  } else {
    Value method = find_method(obj, name);
    if (!method.is_undefined()) return method;
    if (obj.is_dict()) {
      if (const Value* v = obj.as_dict().find(name)) return *v;
    }
  }
  return Value::undefined(object_name(obj) + " has no attribute '" + name + "'");
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) throw TemplateError(obj.hint());
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = obj.as_dict().find(key.as_string())) return *v;
  } else if ((obj.is_list() || obj.is_string()) && key.is_integral()) {
    if (obj.is_list()) {
      const int64_t i = resolve_index(key.as_int(), obj.as_list().size());
      if (i >= 0) return obj.as_list()[size_t(i)];
    } else {
      std::vector<std::string> chars = split_chars(obj.as_string());
      const int64_t i = resolve_index(key.as_int(), chars.size());
      if (i >= 0) return Value::string(std::move(chars[size_t(i)]));
    }
  }
  if (key.is_string()) {
    Value method = find_method(obj, key.as_string());
    if (!method.is_undefined()) return method;
  }
  return Value::undefined(object_name(obj) + " has no attribute " + key.repr());
}

Renderer::Renderer(const RenderOptions& options) : options_(options) {
  if (options_.now == 0) options_.now = std::time(nullptr);
}

Renderer::~Renderer() = default;

void Renderer::check_size(size_t bytes) const {
  if (bytes > options_.max_output_bytes) {
    throw TemplateError("the output would be over " + std::to_string(options_.max_output_bytes) +
                        " bytes");
  }
}

void Renderer::emit(const std::string& text) {
  *out_ += text;
  check_size(out_->size());
}

std::string Renderer::render(const Body& body, const Value& context) {
  root_ = std::make_unique<Frame>();
  if (context.is_dict()) {
    for (const auto& [k, v] : context.as_dict().items) root_->vars[k] = v;
  }
  std::string out;
  out_ = &out;
  exec(body, root_.get());
  return out;
}

Value Renderer::lookup(const std::string& name, Frame* frame) const {
  if (const Value* v = frame->find(name)) return *v;
  Value global = find_global(name, options_.now);
  if (!global.is_undefined()) return global;
  return Value::undefined("'" + name + "' is undefined");
}

Renderer::Flow Renderer::exec(const Body& body, Frame* frame) {
  for (const auto& node : body) {
    try {
      switch (node->kind) {
        case Node::Kind::kText:
          emit(node->text);
          break;
        case Node::Kind::kOutput:
          emit(eval(*node->expr, frame).str());
          break;
        case Node::Kind::kIf:
          for (const auto& [cond, branch] : node->branches) {
            if (cond == nullptr || eval(*cond, frame).truthy()) {
              const Flow flow = exec(branch, frame);
              if (flow != Flow::kNormal) return flow;
              break;
            }
          }
          break;
        case Node::Kind::kFor: {
          exec_for(*node, frame);
          break;
        }
        case Node::Kind::kSet:
        case Node::Kind::kSetBlock:
          exec_set(*node, frame);
          break;
        case Node::Kind::kMacro:
          frame->vars[node->targets[0]] = define_macro(*node);
          break;
        case Node::Kind::kBreak:
          return Flow::kBreak;
        case Node::Kind::kContinue:
          return Flow::kContinue;
      }
    } catch (const TemplateError& e) {
      // The innermost statement names its line; outer ones pass the message on.
      const std::string what = e.what();
      if (e.raised() || what.rfind("line ", 0) == 0) throw;
      throw TemplateError("line " + std::to_string(node->line) + ": " + what);
    }
  }
  return Flow::kNormal;
}

Renderer::Flow Renderer::exec_for(const Node& node, Frame* frame) {
  const Value iterable = eval(*node.expr, frame);
  if (iterable.is_none()) throw TemplateError("'NoneType' object is not iterable");
  List items = iterable.iterate();
  auto bind = [&](Frame* f, const Value& item) { assign(node.targets, item, &f->vars); };
  if (node.filter) {
    List kept;
    for (const Value& item : items) {
      Frame f;
      f.parent = frame;
      bind(&f, item);
      if (eval(*node.filter, &f).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    Frame f;
    f.parent = frame;
    exec(node.else_body, &f);
    return Flow::kNormal;
  }
  const int64_t n = int64_t(items.size());
  for (int64_t i = 0; i < n; ++i) {
    Frame f;
    f.parent = frame;
    bind(&f, items[size_t(i)]);
    auto loop = std::make_shared<Dict>();
    loop->set("index", Value::integer(i + 1));
    loop->set("index0", Value::integer(i));
    loop->set("revindex", Value::integer(n - i));
    loop->set("revindex0", Value::integer(n - i - 1));
    loop->set("first", Value::boolean(i == 0));
    loop->set("last", Value::boolean(i == n - 1));
    loop->set("length", Value::integer(n));
    loop->set("depth", Value::integer(1));
    loop->set("depth0", Value::integer(0));
    if (i > 0) loop->set("previtem", items[size_t(i - 1)]);
    if (i + 1 < n) loop->set("nextitem", items[size_t(i + 1)]);
    loop->set("cycle", Value::callable("cycle", [i](const CallArgs& args) {
                if (args.positional.empty()) throw TemplateError("no items for cycling given");
                return args.positional[size_t(i) % args.positional.size()];
              }));
    loop->is_namespace = true;  // attributes are its items; no dict methods
    f.vars["loop"] = Value::dict(std::move(loop));
    if (exec(node.body, &f) == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Renderer::exec_set(const Node& node, Frame* frame) {
  Value value;
  if (node.kind == Node::Kind::kSetBlock) {
    std::string captured;
    std::string* saved = out_;
    out_ = &captured;
    exec(node.body, frame);
    out_ = saved;
    value = Value::string(std::move(captured));
  } else {
    value = eval(*node.expr, frame);
  }
  if (!node.attribute.empty()) {
    const Value target = lookup(node.targets[0], frame);
    if (!target.is_dict() || !target.as_dict().is_namespace) {
      throw TemplateError("cannot assign attribute on non-namespace object");
    }
    target.mutable_dict().set(node.attribute, std::move(value));
    return;
  }
  assign(node.targets, value, &frame->vars);
}

Value Renderer::define_macro(const Node& node) {
  const Node* macro = &node;
  return Value::callable(node.targets[0], [this, macro](const CallArgs& args) {
    if (args.positional.size() > macro->params.size()) {
      throw TemplateError("macro '" + macro->targets[0] + "' takes not more than " +
                          std::to_string(macro->params.size()) + " argument(s)");
    }
    if (++macro_depth_ > kMaxMacroDepth) {
      --macro_depth_;
      throw TemplateError("macros nest deeper than " + std::to_string(kMaxMacroDepth));
    }
    Frame f;
    f.parent = root_.get();
    for (size_t k = 0; k < macro->params.size(); ++k) {
      const auto& [name, dflt] = macro->params[k];
      if (const Value* v = args.get(k, name)) {
        f.vars[name] = *v;
      } else {
        f.vars[name] = dflt ? eval(*dflt, &f) : Value::undefined("'" + name + "' is undefined");
      }
    }
    for (const auto& [key, v] : args.keyword) {
      bool known = false;
      for (const auto& p : macro->params) known = known || p.first == key;
      if (!known) {
        --macro_depth_;
        throw TemplateError("macro '" + macro->targets[0] + "' takes no keyword argument '" + key +
                            "'");
      }
    }
    std::string captured;
    std::string* saved = out_;
    out_ = &captured;
    try {
      exec(macro->body, &f);
    } catch (...) {
      out_ = saved;
      --macro_depth_;
      throw;
    }
    out_ = saved;
    --macro_depth_;
    return Value::string(std::move(captured));
  });
}

CallArgs Renderer::eval_args(const Expr& e, size_t first, Frame* frame) {
  CallArgs args;
  for (size_t k = first; k < e.args.size(); ++k) args.positional.push_back(eval(*e.args[k], frame));
  for (const auto& [key, value] : e.kwargs) args.keyword.emplace_back(key, eval(*value, frame));
  return args;
}

Value Renderer::apply_filter(const std::string& name, const Value& value, const CallArgs& args) {
  FilterFn fn = find_filter(name);
  if (fn == nullptr) throw TemplateError("no filter named '" + name + "'");
  return fn(*this, value, args);
}

bool Renderer::apply_test(const std::string& name, const Value& value, const CallArgs& args) {
  TestFn fn = find_test(name);
  if (fn == nullptr) throw TemplateError("no test named '" + name + "'");
  if (test_takes_no_argument(name) && !(args.positional.empty() && args.keyword.empty())) {
    throw TemplateError("test '" + name + "' takes no argument");
  }
  return fn(*this, value, args);
}

Value Renderer::eval(const Expr& e, Frame* frame) {
  switch (e.kind) {
    case Expr::Kind::kConst:
      return e.value;
    case Expr::Kind::kName:
      return lookup(e.name, frame);
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      List items;
      for (const auto& a : e.args) items.push_back(eval(*a, frame));
      return Value::list(std::move(items));
    }
    case Expr::Kind::kDict: {
      auto d = std::make_shared<Dict>();
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        Value key = eval(*e.args[k], frame);
        if (!key.is_string()) fail_line(e.line, "dict keys must be strings here");
        d->set(key.as_string(), eval(*e.args[k + 1], frame));
      }
      return Value::dict(std::move(d));
    }
    case Expr::Kind::kGetattr:
      return get_attribute(eval(*e.args[0], frame), e.name);
    case Expr::Kind::kGetitem:
      return get_item(eval(*e.args[0], frame), eval(*e.args[1], frame));
    case Expr::Kind::kSlice: {
      const Value obj = eval(*e.args[0], frame);
      Value parts[3];
      for (int k = 0; k < 3; ++k) {
        if (e.args[size_t(k) + 1]) parts[k] = eval(*e.args[size_t(k) + 1], frame);
      }
      auto part = [&](int k) { return e.args[size_t(k) + 1] ? &parts[k] : nullptr; };
      if (obj.is_undefined()) throw TemplateError(obj.hint());
      if (obj.is_list()) {
        List items;
        for (size_t p : slice_positions(part(0), part(1), part(2), obj.as_list().size())) {
          items.push_back(obj.as_list()[p]);
        }
        return Value::list(std::move(items));
      }
      if (obj.is_string()) {
        const std::vector<std::string> chars = split_chars(obj.as_string());
        std::string s;
        for (size_t p : slice_positions(part(0), part(1), part(2), chars.size())) s += chars[p];
        return Value::string(std::move(s));
      }
      throw TemplateError("'" + obj.type_name() + "' object is not subscriptable");
    }
    case Expr::Kind::kCall: {
      const Value callee = eval(*e.args[0], frame);
      return callee.call(eval_args(e, 1, frame));
    }
    case Expr::Kind::kFilter: {
      const Value input = eval(*e.args[0], frame);
      return apply_filter(e.name, input, eval_args(e, 1, frame));
    }
    case Expr::Kind::kTest: {
      const Value input = eval(*e.args[0], frame);
      return Value::boolean(apply_test(e.name, input, eval_args(e, 1, frame)) != e.negated);
    }
    case Expr::Kind::kNot:
      return Value::boolean(!eval(*e.args[0], frame).truthy());
    case Expr::Kind::kNeg:
    case Expr::Kind::kPos: {
      const Value v = eval(*e.args[0], frame);
      if (!v.is_number()) {
        if (v.is_undefined()) throw TemplateError(v.hint());
        throw TemplateError("bad operand type for unary " +
                            std::string(e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" +
                            v.type_name() + "'");
      }
      if (e.kind == Expr::Kind::kPos) return v.is_integral() ? Value::integer(v.as_int()) : v;
      return v.is_integral() ? Value::integer(-v.as_int()) : Value::number(-v.as_double());
    }
    case Expr::Kind::kBinary:
      return eval_binary(e, frame);
    case Expr::Kind::kCompare:
      return eval_compare(e, frame);
    case Expr::Kind::kCond:
      if (eval(*e.args[0], frame).truthy()) return eval(*e.args[1], frame);
      if (e.args[2]) return eval(*e.args[2], frame);
      return Value::undefined("the conditional expression had no else");
  }
  return Value();
}

Value Renderer::eval_binary(const Expr& e, Frame* frame) {
  Value left = eval(*e.args[0], frame);
  if (e.name == "and") return left.truthy() ? eval(*e.args[1], frame) : left;
  if (e.name == "or") return left.truthy() ? left : eval(*e.args[1], frame);
  return arithmetic(e.name, left, eval(*e.args[1], frame), this);
}

Value Renderer::eval_compare(const Expr& e, Frame* frame) {
  Value left = eval(*e.args[0], frame);
  for (size_t k = 0; k < e.ops.size(); ++k) {
    Value right = eval(*e.args[k + 1], frame);
    const std::string& op = e.ops[k];
    bool result;
    if (op == "==") {
      result = equal(left, right);
    } else if (op == "!=") {
      result = !equal(left, right);
    } else if (op == "<") {
      result = less(left, right);
    } else if (op == ">") {
      result = less(right, left);
    } else if (op == "<=") {
      result = !less(right, left);
    } else if (op == ">=") {
      result = !less(left, right);
    } else if (op == "in") {
      result = contains(right, left);
    } else {
      result = !contains(right, left);
    }
    if (!result) return Value::boolean(false);
    left = std::move(right);
  }
  return Value::boolean(true);
}

StatusOr<std::shared_ptr<const Template>> Template::parse(const std::string& source) {
  // Strings index by character: every string the interpreter makes must be valid UTF-8, and
  // the ones it is given (the source, the context) are.
  if (const size_t bad = detail::first_invalid_utf8(source); bad != source.size()) {
    return InvalidArgument("not valid UTF-8 (at byte " + std::to_string(bad) + ")");
  }
  auto t = std::shared_ptr<Template>(new Template());
  try {
    t->body_ = jinja::parse(lex(source));
  } catch (const TemplateError& e) {
    return InvalidArgument(e.what());
  }
  return std::shared_ptr<const Template>(std::move(t));
}

StatusOr<std::string> Template::render(const Value& context, const RenderOptions& options) const {
  bool raised = false;
  return render(context, options, &raised);
}

StatusOr<std::string> Template::render(const Value& context, const RenderOptions& options,
                                       bool* raised) const {
  *raised = false;
  try {
    Renderer renderer(options);
    return renderer.render(body_, context);
  } catch (const TemplateError& e) {
    *raised = e.raised();
    return InvalidArgument(e.what());
  }
}

}  // namespace treeserve::jinja
