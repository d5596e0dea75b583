// A Jinja2 interpreter for chat templates, with the environment transformers renders them in
// (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loop-controls
// extension; raise_exception and strftime_now as globals; a tojson filter that is
// json.dumps(ensure_ascii=False), not Jinja's HTML-escaping one). What it covers:
//  - text with {{ }}, {% %} and {# #}, the -/+ whitespace controls, trim_blocks and
//    lstrip_blocks as Jinja's lexer applies them, and one trailing newline dropped;
//  - statements: if/elif/else, for (tuple targets, `if` filter, else, loop.index/index0/
//    revindex/revindex0/first/last/length/previtem/nextitem/cycle), break, continue, set
//    (names, tuples, namespace attributes, {% set x %}...{% endset %} blocks), macro, and
//    transformers' {% generation %} block (rendered as its body);
//  - expressions with Jinja's precedence: literals, lists, dicts, tuples, attribute and item
//    access, slices, calls with keyword arguments, filters, `is` tests, not/and/or (returning
//    operands, as Python does), comparisons (chained), in / not in, + - * / // % ** ~,
//    conditional expressions;
//  - the filters, tests, globals (range, dict, namespace, raise_exception, strftime_now) and
//    str/dict methods chat templates use (listed in models/jinja_filters.cpp and
//    models/jinja_builtins.cpp).
// A filter or test the interpreter does not know is an error at parse time, as in Jinja.
// include/extends/import, call blocks and raw blocks are not supported (a parse error naming
// the tag).
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "models/detail/jinja_value.h"

namespace treeserve::jinja {

// ---- syntax tree ------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kConst,    // value
    kName,     // name
    kList,     // args
    kTuple,    // args (evaluated as a list)
    kDict,     // args: key, value, key, value, ...
    kGetattr,  // args[0] . name
    kGetitem,  // args[0] [ args[1] ]
    kSlice,    // args[0] [ args[1] : args[2] : args[3] ] (null parts absent)
    kCall,     // args[0] ( args[1..], kwargs )
    kFilter,   // args[0] | name ( args[1..], kwargs )
    kTest,     // args[0] is [not] name ( args[1..], kwargs ); negated
    kNot,      // not args[0]
    kNeg,      // -args[0]
    kPos,      // +args[0]
    kBinary,   // args[0] op args[1]: + - * / // % ** ~ and or
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ...: == != < <= > >= in notin
    kCond,     // args[1] if args[0] else args[2] (args[2] null: undefined)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  std::vector<std::string> ops;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negated = false;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue };
  Kind kind;
  int line = 0;
  std::string text;  // kText
  ExprPtr expr;      // kOutput; kSet value; kFor iterable
  // kIf: (condition, body) per if/elif, then (null, else body).
  std::vector<std::pair<ExprPtr, Body>> branches;
  // kFor: loop targets; kSet/kSetBlock: names assigned (several: tuple unpacking), or one
  // name with `attribute` set for `set ns.attribute = ...`; kMacro: the macro's name.
  std::vector<std::string> targets;
  std::string attribute;
  ExprPtr filter;  // kFor: the `if` after the iterable
  Body body;       // kFor, kSetBlock, kMacro
  Body else_body;  // kFor
  // kMacro: parameters with their defaults (null: none).
  std::vector<std::pair<std::string, ExprPtr>> params;
};

// ---- lexer ------------------------------------------------------------------------------

struct Token {
  enum class Kind {
    kText,        // text between tags (whitespace control already applied)
    kVarBegin,    // {{
    kVarEnd,      // }}
    kBlockBegin,  // {%
    kBlockEnd,    // %}
    kName,
    kString,
    kInteger,
    kFloat,
    kOperator,
    kEnd,  // end of the template
  };
  Kind kind;
  std::string text;  // the text, name, operator or the string's decoded value
  int line = 0;
  int64_t integer = 0;
  double number = 0.0;
};

// Splits a template into tokens; TemplateError (with the line) on an unterminated tag,
// comment or string, or a character no token starts with.
std::vector<Token> lex(const std::string& source);

// ---- parser -----------------------------------------------------------------------------

// TemplateError naming the line on a syntax error, an unknown or unsupported tag, or an
// unknown filter or test.
Body parse(const std::vector<Token>& tokens);

// ---- builtins (models/jinja_filters.cpp, models/jinja_builtins.cpp) -----------------------

class Renderer;
using FilterFn = Value (*)(Renderer&, const Value&, const CallArgs&);
using TestFn = bool (*)(Renderer&, const Value&, const CallArgs&);
FilterFn find_filter(const std::string& name);  // nullptr when unknown
TestFn find_test(const std::string& name);      // nullptr when unknown
bool test_takes_no_argument(const std::string& name);
// `value.name` for a str or dict method (a bound callable), else undefined.
Value find_method(const Value& value, const std::string& name);
// The globals: range, dict, namespace, raise_exception, strftime_now (at `now`).
Value find_global(const std::string& name, std::time_t now);

// ---- rendering ----------------------------------------------------------------------------

struct RenderOptions {
  std::time_t now = 0;  // strftime_now's clock (local time); 0 = the current time
  // The longest output (and any string built on the way); longer is a TemplateError.
  size_t max_output_bytes = size_t(64) << 20;
};

// One rendering of a syntax tree (models/jinja_render.cpp). Not thread-safe; a Template
// makes one per render call.
class Renderer {
 public:
  explicit Renderer(const RenderOptions& options);
  ~Renderer();
  std::string render(const Body& body, const Value& context);

  // For the builtins: filters and tests by name (map, select, selectattr...), the size bound
  // and the clock.
  Value apply_filter(const std::string& name, const Value& value, const CallArgs& args);
  bool apply_test(const std::string& name, const Value& value, const CallArgs& args);
  void check_size(size_t bytes) const;
  std::time_t now() const { return options_.now; }

 private:
  struct Frame;
  enum class Flow { kNormal, kBreak, kContinue };

  Flow exec(const Body& body, Frame* frame);
  Flow exec_for(const Node& node, Frame* frame);
  void exec_set(const Node& node, Frame* frame);
  Value define_macro(const Node& node);
  Value eval(const Expr& e, Frame* frame);
  Value eval_binary(const Expr& e, Frame* frame);
  Value eval_compare(const Expr& e, Frame* frame);
  CallArgs eval_args(const Expr& e, size_t first, Frame* frame);
  Value lookup(const std::string& name, Frame* frame) const;
  void emit(const std::string& text);

  RenderOptions options_;
  std::string* out_ = nullptr;
  std::unique_ptr<Frame> root_;
  int macro_depth_ = 0;
};

// Attribute and item access as Jinja's environment does them: `obj.name` tries a method of
// obj, then the item; `obj[key]` the item, then a method. A miss is undefined (with a hint
// for the error its use raises); on an undefined obj it is an error.
Value get_attribute(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);

class Template {
 public:
  // INVALID_ARGUMENT "line N: ..." when the source does not parse, or when it is not valid
  // UTF-8. The context given to render must hold valid UTF-8 strings only.
  static StatusOr<std::shared_ptr<const Template>> parse(const std::string& source);
  // Renders with `context` (a dict: the template's variables). INVALID_ARGUMENT with the
  // message of the failure (a raise_exception() message as the template wrote it).
  StatusOr<std::string> render(const Value& context, const RenderOptions& options = {}) const;
  // Like render, but says whether a failure came from the template's raise_exception().
  StatusOr<std::string> render(const Value& context, const RenderOptions& options,
                               bool* raised) const;

 private:
  Body body_;
};

}  // namespace treeserve::jinja
