// The values of the Jinja interpreter (models/detail/jinja.h): Python's data model as chat
// templates see it through Jinja2. Strings are UTF-8 and index by character; lists and dicts
// are shared by reference, as in Python (a namespace() set in a loop is the one read after
// it); dicts keep their insertion order (tojson writes keys in that order, as json.dumps does).
// Undefined is Jinja's default Undefined: it prints as "", is false, iterates as empty, and
// any attribute, item or arithmetic on it is an error.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace treeserve::jinja {

// Every failure while parsing or rendering: the interpreter throws it and Template's
// parse/render turn it into a Status (it never leaves models/). A template's own
// raise_exception() throws it too, with `raised` set.
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& message, bool raised = false)
      : std::runtime_error(message), raised_(raised) {}
  bool raised() const { return raised_; }

 private:
  bool raised_;
};

class Value;
using List = std::vector<Value>;

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;  // namespace(): the one object `set x.attr = ...` may change

  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // Positional argument `index`, else keyword `name`, else nullptr.
  const Value* get(size_t index, std::string_view name) const;
};

using Function = std::function<Value(const CallArgs&)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() = default;  // undefined
  static Value undefined(std::string hint = "");
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value list(List items = {});
  static Value dict(std::shared_ptr<Dict> d = nullptr);
  static Value callable(std::string name, Function fn);
  // JSON null, booleans, numbers, strings, arrays and objects (keys in document order).
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  // bool, int and float: Python's numbers (bool is an int there).
  bool is_number() const {
    return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat;
  }
  bool is_integral() const { return kind_ == Kind::kBool || kind_ == Kind::kInt; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::kFloat ? int64_t(f_) : i_; }
  double as_double() const { return kind_ == Kind::kFloat ? f_ : double(i_); }
  const std::string& as_string() const { return s_; }
  const List& as_list() const { return *list_; }
  List& mutable_list() { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& mutable_dict() const { return *dict_; }
  const std::shared_ptr<Dict>& dict_ptr() const { return dict_; }
  Value call(const CallArgs& args) const;
  // For undefined values: what was looked up ("'x' is undefined"); for callables, the name.
  const std::string& hint() const { return s_; }

  bool truthy() const;            // Python's bool()
  std::string str() const;        // Python's str(); undefined prints as ""
  std::string repr() const;       // Python's repr()
  std::string type_name() const;  // Python's type name ("str", "dict", ...), for messages
  // Python's json.dumps(self, ensure_ascii=False, indent, separators, sort_keys): indent < 0
  // is None (one line, separators ", " and ": "); otherwise a newline and indent_text per
  // level, with "," between items.
  std::string to_json(const std::string* indent_text, const std::string& item_sep,
                      const std::string& key_sep, bool sort_keys) const;

  // Iteration as a for loop sees it: list items, dict keys, string characters; undefined
  // iterates as empty. Anything else is a TemplateError.
  List iterate() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0.0;
  std::string s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
};

// Python's ==, across kinds (1 == 1.0 == True; dicts equal by their items in any order).
bool equal(const Value& a, const Value& b);
// Python's <: numbers, strings (by code point) and lists (element-wise); other pairs are
// a TemplateError.
bool less(const Value& a, const Value& b);

// Python's repr() of a float ("1.0", "1e-05", "1.2345678901234568e+17").
std::string float_repr(double f);

// ---- characters (strings index by code point, as Python's str does) -----------------

std::vector<std::string> split_chars(std::string_view s);
size_t char_count(std::string_view s);
bool is_python_space(uint32_t cp);  // str.isspace()

}  // namespace treeserve::jinja
