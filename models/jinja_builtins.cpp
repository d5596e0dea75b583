// The Jinja interpreter's tests, methods and globals (models/detail/jinja.h), with Jinja2's
// and Python's semantics (the filters are models/jinja_filters.cpp):
//  tests: the comparison tests (eq, equalto, ==, ne, !=, lt, lessthan, <, le, <=, gt,
//    greaterthan, >, ge, >=), boolean, callable, defined, divisibleby, escaped, even, false,
//    filter, float, in, integer, iterable, lower, mapping, none, number, odd, sameas,
//    sequence, string, test, true, undefined, upper;
//  globals: dict, namespace, range, raise_exception, strftime_now;
//  str methods: capitalize, count, endswith, find, isalnum, isalpha, isdigit, islower,
//    isspace, isupper, join, lower, lstrip, replace, rstrip, split, splitlines, startswith,
//    strip, title, upper; dict methods: get, items, keys, values.
#include "models/detail/jinja_builtins.h"

#include <utf8proc.h>

#include <algorithm>
#include <map>
#include <set>

#include "models/detail/jinja.h"
#include "models/detail/unicode.h"

namespace treeserve::jinja {
namespace {

// Jinja's sandbox refuses ranges longer than this.
constexpr int64_t kMaxRange = 100000;

// ---- tests ------------------------------------------------------------------------------

const Value& test_arg(const CallArgs& a, const char* test) {
  if (a.positional.empty())
    throw TemplateError(std::string("test '") + test + "' needs an argument");
  return a.positional[0];
}

bool t_defined(Renderer&, const Value& v, const CallArgs&) { return !v.is_undefined(); }
bool t_undefined(Renderer&, const Value& v, const CallArgs&) { return v.is_undefined(); }
bool t_none(Renderer&, const Value& v, const CallArgs&) { return v.is_none(); }
bool t_boolean(Renderer&, const Value& v, const CallArgs&) {
  return v.kind() == Value::Kind::kBool;
}
bool t_true(Renderer&, const Value& v, const CallArgs&) {
  return v.kind() == Value::Kind::kBool && v.as_bool();
}
bool t_false(Renderer&, const Value& v, const CallArgs&) {
  return v.kind() == Value::Kind::kBool && !v.as_bool();
}
bool t_integer(Renderer&, const Value& v, const CallArgs&) { return v.kind() == Value::Kind::kInt; }
bool t_float(Renderer&, const Value& v, const CallArgs&) { return v.kind() == Value::Kind::kFloat; }
bool t_number(Renderer&, const Value& v, const CallArgs&) { return v.is_number(); }
bool t_string(Renderer&, const Value& v, const CallArgs&) { return v.is_string(); }
bool t_mapping(Renderer&, const Value& v, const CallArgs&) {
  return v.is_dict() && !v.as_dict().is_namespace;
}
bool t_iterable(Renderer&, const Value& v, const CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool t_sequence(Renderer& r, const Value& v, const CallArgs& a) { return t_iterable(r, v, a); }
bool t_callable(Renderer&, const Value& v, const CallArgs&) { return v.is_callable(); }
bool t_odd(Renderer&, const Value& v, const CallArgs&) {
  if (!v.is_integral()) throw TemplateError("test 'odd' needs an integer");
  return v.as_int() % 2 != 0;
}
bool t_even(Renderer&, const Value& v, const CallArgs&) {
  if (!v.is_integral()) throw TemplateError("test 'even' needs an integer");
  return v.as_int() % 2 == 0;
}
bool t_divisibleby(Renderer&, const Value& v, const CallArgs& a) {
  const Value& n = test_arg(a, "divisibleby");
  if (!v.is_integral() || !n.is_integral() || n.as_int() == 0) {
    throw TemplateError("test 'divisibleby' needs integers (and a non-zero divisor)");
  }
  return v.as_int() % n.as_int() == 0;
}
bool t_eq(Renderer&, const Value& v, const CallArgs& a) { return equal(v, test_arg(a, "eq")); }
bool t_ne(Renderer&, const Value& v, const CallArgs& a) { return !equal(v, test_arg(a, "ne")); }
bool t_lt(Renderer&, const Value& v, const CallArgs& a) { return less(v, test_arg(a, "lt")); }
bool t_le(Renderer&, const Value& v, const CallArgs& a) { return !less(test_arg(a, "le"), v); }
bool t_gt(Renderer&, const Value& v, const CallArgs& a) { return less(test_arg(a, "gt"), v); }
bool t_ge(Renderer&, const Value& v, const CallArgs& a) { return !less(v, test_arg(a, "ge")); }
bool t_in(Renderer&, const Value& v, const CallArgs& a) {
  const Value& seq = test_arg(a, "in");
  if (seq.is_string())
    return v.is_string() && seq.as_string().find(v.as_string()) != std::string::npos;
  if (seq.is_dict()) return v.is_string() && seq.as_dict().find(v.as_string()) != nullptr;
  for (const Value& item : seq.iterate()) {
    if (equal(item, v)) return true;
  }
  return false;
}
bool t_sameas(Renderer&, const Value& v, const CallArgs& a) {
  const Value& other = test_arg(a, "sameas");
  if (v.kind() != other.kind()) return false;
  if (v.is_list()) return &v.as_list() == &other.as_list();
  if (v.is_dict()) return v.dict_ptr() == other.dict_ptr();
  return equal(v, other);
}
bool t_lower(Renderer&, const Value& v, const CallArgs&) {
  return v.is_string() && map_case(v.as_string(), false) == v.as_string();
}
bool t_upper(Renderer&, const Value& v, const CallArgs&) {
  return v.is_string() && map_case(v.as_string(), true) == v.as_string();
}
bool t_escaped(Renderer&, const Value&, const CallArgs&) { return false; }
bool t_filter(Renderer&, const Value& v, const CallArgs&) {
  return v.is_string() && find_filter(v.as_string()) != nullptr;
}
bool t_test(Renderer&, const Value& v, const CallArgs&) {
  return v.is_string() && find_test(v.as_string()) != nullptr;
}

// ---- methods ----------------------------------------------------------------------------

Value bound(const std::string& name, std::function<Value(const CallArgs&)> fn) {
  return Value::callable(name, std::move(fn));
}

bool all_chars(const std::string& s, bool (*pred)(uint32_t)) {
  std::vector<uint32_t> cps = code_points(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), pred);
}

Value string_method(const std::string& s, const std::string& name) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool left = name != "rstrip", right = name != "lstrip";
    return bound(name, [s, left, right](const CallArgs& a) {
      return Value::string(strip(s, arg(a, 0, "chars"), left, right));
    });
  }
  if (name == "split") {
    return bound(name, [s](const CallArgs& a) {
      return Value::list(python_split(s, arg(a, 0, "sep"), arg_int(a, 1, "maxsplit", -1)));
    });
  }
  if (name == "splitlines") {
    return bound(name, [s](const CallArgs& a) {
      const bool keep = arg_bool(a, 0, "keepends", false);
      List lines;
      size_t start = 0;
      while (start < s.size()) {
        size_t nl = s.find('\n', start);
        if (nl == std::string::npos) nl = s.size();
        lines.push_back(Value::string(s.substr(start, nl - start + (keep && nl < s.size()))));
        start = nl + 1;
      }
      return Value::list(std::move(lines));
    });
  }
  if (name == "startswith" || name == "endswith") {
    const bool starts = name == "startswith";
    return bound(name, [s, starts](const CallArgs& a) {
      if (a.positional.empty()) throw TemplateError("startswith/endswith: missing the prefix");
      const Value& p = a.positional[0];
      List options = p.is_list() ? p.as_list() : List{p};
      for (const Value& o : options) {
        const std::string x = o.str();
        if (x.size() <= s.size() && (starts ? s.compare(0, x.size(), x) == 0
                                            : s.compare(s.size() - x.size(), x.size(), x) == 0)) {
          return Value::boolean(true);
        }
      }
      return Value::boolean(false);
    });
  }
  if (name == "upper" || name == "lower") {
    const bool upper = name == "upper";
    return bound(name, [s, upper](const CallArgs&) { return Value::string(map_case(s, upper)); });
  }
  if (name == "title") {
    return bound(name, [s](const CallArgs&) { return Value::string(python_title(s)); });
  }
  if (name == "capitalize") {
    return bound(name, [s](const CallArgs&) { return Value::string(capitalize(s)); });
  }
  if (name == "replace") {
    return bound(name, [s](const CallArgs& a) {
      if (a.positional.size() < 2) throw TemplateError("replace: needs old and new");
      return Value::string(
          replace_all(s, a.positional[0].str(), a.positional[1].str(), arg_int(a, 2, "count", -1)));
    });
  }
  if (name == "find" || name == "count") {
    const bool find = name == "find";
    return bound(name, [s, find](const CallArgs& a) {
      if (a.positional.empty()) throw TemplateError("find/count: missing the substring");
      const std::string sub = a.positional[0].str();
      if (find) {
        const size_t at = s.find(sub);
        return Value::integer(at == std::string::npos ? -1 : int64_t(char_count(s.substr(0, at))));
      }
      if (sub.empty()) return Value::integer(int64_t(char_count(s)) + 1);
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value::integer(n);
    });
  }
  if (name == "join") {
    return bound(name, [s](const CallArgs& a) {
      if (a.positional.empty()) throw TemplateError("join: missing the iterable");
      std::string out;
      bool first = true;
      for (const Value& item : a.positional[0].iterate()) {
        if (!item.is_string())
          throw TemplateError("join: expected str items, got " + item.type_name());
        if (!first) out += s;
        first = false;
        out += item.as_string();
      }
      return Value::string(std::move(out));
    });
  }
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
      name == "islower" || name == "isupper") {
    return bound(name, [s, name](const CallArgs&) {
      if (name == "isspace") return Value::boolean(all_chars(s, is_python_space));
      if (name == "isdigit") {
        return Value::boolean(all_chars(s, [](uint32_t c) {
          return utf8proc_category(utf8proc_int32_t(c)) == UTF8PROC_CATEGORY_ND;
        }));
      }
      if (name == "isalpha") {
        return Value::boolean(all_chars(s, [](uint32_t c) {
          const auto cat = utf8proc_category(utf8proc_int32_t(c));
          return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
        }));
      }
      if (name == "isalnum") return Value::boolean(all_chars(s, detail::is_alphanumeric));
      const bool want_upper = name == "isupper";
      bool any_cased = false;
      for (uint32_t c : code_points(s)) {
        if (!is_cased(c)) continue;
        any_cased = true;
        const bool up = utf8proc_tolower(utf8proc_int32_t(c)) != utf8proc_int32_t(c);
        if (up != want_upper) return Value::boolean(false);
      }
      return Value::boolean(any_cased);
    });
  }
  return Value();
}

Value dict_method(const Value& d, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return bound(name, [d, name](const CallArgs&) {
      List out;
      for (const auto& [k, v] : d.as_dict().items) {
        if (name == "items") out.push_back(Value::list({Value::string(k), v}));
        if (name == "keys") out.push_back(Value::string(k));
        if (name == "values") out.push_back(v);
      }
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return bound(name, [d](const CallArgs& a) {
      if (a.positional.empty()) throw TemplateError("get: missing the key");
      const Value* dflt = arg(a, 1, "default");
      const Value* v =
          a.positional[0].is_string() ? d.as_dict().find(a.positional[0].as_string()) : nullptr;
      return v ? *v : dflt ? *dflt : Value::none();
    });
  }
  return Value();
}

// ---- globals ----------------------------------------------------------------------------

Value g_range(const CallArgs& a) {
  int64_t start = 0, stop = 0, step = 1;
  if (a.positional.size() == 1) {
    stop = arg_int(a, 0, "stop", 0);
  } else if (a.positional.size() >= 2) {
    start = arg_int(a, 0, "start", 0);
    stop = arg_int(a, 1, "stop", 0);
    step = arg_int(a, 2, "step", 1);
  } else {
    throw TemplateError("range expected at least 1 argument");
  }
  if (step == 0) throw TemplateError("range() arg 3 must not be zero");
  List out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (int64_t(out.size()) >= kMaxRange) {
      throw TemplateError(
          "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    out.push_back(Value::integer(i));
  }
  return Value::list(std::move(out));
}

Value make_dict(const CallArgs& a, bool is_namespace) {
  auto d = std::make_shared<Dict>();
  d->is_namespace = is_namespace;
  for (const Value& p : a.positional) {
    if (!p.is_dict()) throw TemplateError("expected keyword arguments or a mapping");
    for (const auto& [k, v] : p.as_dict().items) d->set(k, v);
  }
  for (const auto& [k, v] : a.keyword) d->set(k, v);
  return Value::dict(std::move(d));
}

}  // namespace

// Tests that take no argument besides the value: an argument is an error, as in Jinja.
bool test_takes_no_argument(const std::string& name) {
  static const std::set<std::string> kNoArgument = {
      "boolean", "callable", "defined",  "escaped", "even",    "false",     "filter",
      "float",   "integer",  "iterable", "lower",   "mapping", "none",      "number",
      "odd",     "sequence", "string",   "test",    "true",    "undefined", "upper"};
  return kNoArgument.count(name) != 0;
}

TestFn find_test(const std::string& name) {
  static const std::map<std::string, TestFn> kTests = {
      {"boolean", t_boolean},
      {"callable", t_callable},
      {"defined", t_defined},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"==", t_eq},
      {"escaped", t_escaped},
      {"even", t_even},
      {"false", t_false},
      {"filter", t_filter},
      {"float", t_float},
      {"ge", t_ge},
      {">=", t_ge},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"in", t_in},
      {"integer", t_integer},
      {"iterable", t_iterable},
      {"le", t_le},
      {"<=", t_le},
      {"lower", t_lower},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"mapping", t_mapping},
      {"ne", t_ne},
      {"!=", t_ne},
      {"none", t_none},
      {"number", t_number},
      {"odd", t_odd},
      {"sameas", t_sameas},
      {"sequence", t_sequence},
      {"string", t_string},
      {"test", t_test},
      {"true", t_true},
      {"undefined", t_undefined},
      {"upper", t_upper},
  };
  auto it = kTests.find(name);
  return it == kTests.end() ? nullptr : it->second;
}

Value find_method(const Value& value, const std::string& name) {
  if (value.is_string()) return string_method(value.as_string(), name);
  if (value.is_dict() && !value.as_dict().is_namespace) return dict_method(value, name);
  return Value();
}

Value find_global(const std::string& name, std::time_t now) {
  if (name == "range") return Value::callable(name, g_range);
  if (name == "dict") {
    return Value::callable(name, [](const CallArgs& a) { return make_dict(a, false); });
  }
  if (name == "namespace") {
    return Value::callable(name, [](const CallArgs& a) { return make_dict(a, true); });
  }
  if (name == "raise_exception") {
    return Value::callable(name, [](const CallArgs& a) -> Value {
      throw TemplateError(a.positional.empty() ? "raise_exception() called" : a.positional[0].str(),
                          /*raised=*/true);
    });
  }
  if (name == "strftime_now") {
    return Value::callable(name, [now](const CallArgs& a) {
      if (a.positional.empty()) throw TemplateError("strftime_now: missing the format");
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), a.positional[0].str().c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  }
  return Value();
}

}  // namespace treeserve::jinja
