// The Jinja filters (models/detail/jinja.h), with Jinja2's semantics: abs, attr, capitalize,
// count, d, default, dictsort, e, escape, first, float, forceescape, indent, int, items, join,
// last, length, list, lower, map, max, min, reject, rejectattr, replace, reverse, round, safe,
// select, selectattr, sort, string, sum, title, tojson (transformers' json.dumps form), trim,
// unique, upper.
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include "models/detail/jinja.h"
#include "models/detail/jinja_builtins.h"

namespace treeserve::jinja {
namespace {

// ---- filters ----------------------------------------------------------------------------

Value f_trim(Renderer&, const Value& v, const CallArgs& a) {
  return Value::string(strip(v.str(), arg(a, 0, "chars"), true, true));
}

Value f_length(Renderer&, const Value& v, const CallArgs&) { return Value::integer(length_of(v)); }

Value f_tojson(Renderer& r, const Value& v, const CallArgs& a) {
  const Value* indent = arg(a, 0, "indent");
  std::string indent_text;
  const std::string* indent_ptr = nullptr;
  if (indent != nullptr && !indent->is_none()) {
    indent_text = indent->is_string()
                      ? indent->as_string()
                      : std::string(size_t(std::max<int64_t>(indent->as_int(), 0)), ' ');
    indent_ptr = &indent_text;
  }
  std::string item_sep = indent_ptr ? "," : ", ", key_sep = ": ";
  if (const Value* seps = arg(a, 1, "separators"); seps != nullptr && !seps->is_none()) {
    const List parts = seps->iterate();
    if (parts.size() != 2) throw TemplateError("tojson: separators must be a pair of strings");
    item_sep = parts[0].str();
    key_sep = parts[1].str();
  }
  std::string out = v.to_json(indent_ptr, item_sep, key_sep, arg_bool(a, 2, "sort_keys", false));
  r.check_size(out.size());
  return Value::string(std::move(out));
}

Value f_string(Renderer&, const Value& v, const CallArgs&) { return Value::string(v.str()); }

Value f_int(Renderer&, const Value& v, const CallArgs& a) {
  if (v.is_undefined()) throw TemplateError(v.hint());  // int(Undefined) fails in Jinja
  const int64_t dflt = arg_int(a, 0, "default", 0);
  if (v.is_number()) return Value::integer(v.as_int());
  if (v.is_string()) {
    std::string s = strip(v.as_string(), nullptr, true, true);
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    if (!s.empty()) {
      char* end = nullptr;
      const long long i = std::strtoll(s.c_str(), &end, 10);
      if (*end == '\0') return Value::integer(i);
      const double f = std::strtod(s.c_str(), &end);
      if (*end == '\0' && std::isfinite(f)) return Value::integer(int64_t(f));
    }
  }
  return Value::integer(dflt);
}

Value f_float(Renderer&, const Value& v, const CallArgs& a) {
  if (v.is_undefined()) throw TemplateError(v.hint());
  const Value* d = arg(a, 0, "default");
  const double dflt = d && d->is_number() ? d->as_double() : 0.0;
  if (v.is_number()) return Value::number(v.as_double());
  if (v.is_string()) {
    const std::string s = strip(v.as_string(), nullptr, true, true);
    char* end = nullptr;
    const double f = std::strtod(s.c_str(), &end);
    if (!s.empty() && *end == '\0') return Value::number(f);
  }
  return Value::number(dflt);
}

Value f_list(Renderer&, const Value& v, const CallArgs&) { return Value::list(v.iterate()); }

Value f_first(Renderer&, const Value& v, const CallArgs&) {
  const List items = v.iterate();
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(Renderer&, const Value& v, const CallArgs&) {
  const List items = v.iterate();
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value f_join(Renderer& r, const Value& v, const CallArgs& a) {
  const std::string sep = arg_str(a, 0, "d", "");
  const Value* attribute = arg(a, 1, "attribute");
  std::string out;
  bool first = true;
  for (const Value& item : v.iterate()) {
    if (!first) out += sep;
    first = false;
    out += (attribute ? attribute_path(item, attribute->str()) : item).str();
    r.check_size(out.size());
  }
  return Value::string(std::move(out));
}

Value f_upper(Renderer&, const Value& v, const CallArgs&) {
  return Value::string(map_case(v.str(), true));
}
Value f_lower(Renderer&, const Value& v, const CallArgs&) {
  return Value::string(map_case(v.str(), false));
}
Value f_capitalize(Renderer&, const Value& v, const CallArgs&) {
  return Value::string(capitalize(v.str()));
}

// Jinja's title filter: each word (after "-", whitespace, or an opening bracket) capitalized.
Value f_title(Renderer&, const Value& v, const CallArgs&) {
  std::vector<uint32_t> cps = code_points(v.str());
  bool word_start = true;
  for (uint32_t& cp : cps) {
    const bool boundary =
        cp == '-' || is_python_space(cp) || cp == '(' || cp == '{' || cp == '[' || cp == '<';
    if (boundary) {
      word_start = true;
      continue;
    }
    cp = uint32_t(word_start ? utf8proc_toupper(utf8proc_int32_t(cp))
                             : utf8proc_tolower(utf8proc_int32_t(cp)));
    word_start = false;
  }
  return Value::string(from_code_points(cps));
}

Value f_replace(Renderer& r, const Value& v, const CallArgs& a) {
  const Value* from = arg(a, 0, "old");
  const Value* to = arg(a, 1, "new");
  if (from == nullptr || to == nullptr) throw TemplateError("replace: needs old and new");
  std::string out = replace_all(v.str(), from->str(), to->str(), arg_int(a, 2, "count", -1));
  r.check_size(out.size());
  return Value::string(std::move(out));
}

Value f_default(Renderer&, const Value& v, const CallArgs& a) {
  const Value* d = arg(a, 0, "default_value");
  const bool boolean = arg_bool(a, 1, "boolean", false);
  if (v.is_undefined() || (boolean && !v.truthy())) return d ? *d : Value::string("");
  return v;
}

Value f_items(Renderer&, const Value& v, const CallArgs&) {
  List out;
  if (v.is_undefined()) return Value::list();
  if (!v.is_dict()) throw TemplateError("items: expected a mapping, got " + v.type_name());
  for (const auto& [k, val] : v.as_dict().items)
    out.push_back(Value::list({Value::string(k), val}));
  return Value::list(std::move(out));
}

Value f_dictsort(Renderer&, const Value& v, const CallArgs& a) {
  if (!v.is_dict()) throw TemplateError("dictsort: expected a mapping, got " + v.type_name());
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const std::string by = arg_str(a, 1, "by", "key");
  const bool reverse = arg_bool(a, 2, "reverse", false);
  const size_t pos = by == "key" ? 0 : by == "value" ? 1 : 2;
  if (pos == 2) throw TemplateError("dictsort: 'by' must be 'key' or 'value'");
  List pairs;
  for (const auto& [k, val] : v.as_dict().items)
    pairs.push_back(Value::list({Value::string(k), val}));
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
    const Value kx = fold_case(x.as_list()[pos], case_sensitive);
    const Value ky = fold_case(y.as_list()[pos], case_sensitive);
    return reverse ? less(ky, kx) : less(kx, ky);
  });
  return Value::list(std::move(pairs));
}

// select / reject / selectattr / rejectattr: the items whose (attribute) passes the test
// (named by the first argument after the attribute; none: truthiness).
Value select_items(Renderer& r, const Value& v, const CallArgs& a, bool by_attribute,
                   bool keep_when) {
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (a.positional.empty()) throw TemplateError("selectattr/rejectattr: missing the attribute");
    attribute = a.positional[0].str();
    next = 1;
  }
  std::string test;
  CallArgs test_args;
  if (next < a.positional.size()) {
    test = a.positional[next].str();
    test_args.positional.assign(a.positional.begin() + std::ptrdiff_t(next) + 1,
                                a.positional.end());
    test_args.keyword = a.keyword;
  }
  List out;
  for (const Value& item : v.iterate()) {
    const Value subject = by_attribute ? attribute_path(item, attribute) : item;
    const bool pass = test.empty() ? subject.truthy() : r.apply_test(test, subject, test_args);
    if (pass == keep_when) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value f_select(Renderer& r, const Value& v, const CallArgs& a) {
  return select_items(r, v, a, false, true);
}
Value f_reject(Renderer& r, const Value& v, const CallArgs& a) {
  return select_items(r, v, a, false, false);
}
Value f_selectattr(Renderer& r, const Value& v, const CallArgs& a) {
  return select_items(r, v, a, true, true);
}
Value f_rejectattr(Renderer& r, const Value& v, const CallArgs& a) {
  return select_items(r, v, a, true, false);
}

Value f_map(Renderer& r, const Value& v, const CallArgs& a) {
  List out;
  const Value* attribute = nullptr;
  const Value* dflt = nullptr;
  for (const auto& [k, val] : a.keyword) {
    if (k == "attribute") attribute = &val;
    if (k == "default") dflt = &val;
  }
  if (attribute != nullptr) {
    for (const Value& item : v.iterate()) {
      Value x = attribute_path(item, attribute->str());
      out.push_back(x.is_undefined() && dflt ? *dflt : x);
    }
    return Value::list(std::move(out));
  }
  if (a.positional.empty()) throw TemplateError("map: needs a filter name or attribute=");
  const std::string filter = a.positional[0].str();
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const Value& item : v.iterate()) out.push_back(r.apply_filter(filter, item, rest));
  return Value::list(std::move(out));
}

Value f_unique(Renderer&, const Value& v, const CallArgs& a) {
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const Value* attribute = arg(a, 1, "attribute");
  List out, seen;
  for (const Value& item : v.iterate()) {
    const Value key =
        fold_case(attribute ? attribute_path(item, attribute->str()) : item, case_sensitive);
    bool dup = false;
    for (const Value& s : seen) dup = dup || equal(s, key);
    if (!dup) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::list(std::move(out));
}

Value f_sort(Renderer&, const Value& v, const CallArgs& a) {
  const bool reverse = arg_bool(a, 0, "reverse", false);
  const bool case_sensitive = arg_bool(a, 1, "case_sensitive", false);
  const Value* attribute = arg(a, 2, "attribute");
  List items = v.iterate();
  auto key = [&](const Value& item) {
    return fold_case(attribute ? attribute_path(item, attribute->str()) : item, case_sensitive);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? less(key(y), key(x)) : less(key(x), key(y));
  });
  return Value::list(std::move(items));
}

Value f_reverse(Renderer&, const Value& v, const CallArgs&) {
  if (v.is_string()) {
    std::vector<std::string> chars = split_chars(v.as_string());
    std::string out;
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
    return Value::string(std::move(out));
  }
  List items = v.iterate();
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_sum(Renderer&, const Value& v, const CallArgs& a) {
  const Value* attribute = arg(a, 0, "attribute");
  const Value* start = arg(a, 1, "start");
  Value total = start ? *start : Value::integer(0);
  for (const Value& item : v.iterate()) {
    const Value x = attribute ? attribute_path(item, attribute->str()) : item;
    if (!total.is_number() || !x.is_number()) {
      throw TemplateError("sum: unsupported operand types '" + total.type_name() + "' and '" +
                          x.type_name() + "'");
    }
    total = total.is_integral() && x.is_integral()
                ? Value::integer(total.as_int() + x.as_int())
                : Value::number(total.as_double() + x.as_double());
  }
  return total;
}

Value min_max(const Value& v, const CallArgs& a, bool want_max) {
  const bool case_sensitive = arg_bool(a, 0, "case_sensitive", false);
  const Value* attribute = arg(a, 1, "attribute");
  const List items = v.iterate();
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  auto key = [&](const Value& item) {
    return fold_case(attribute ? attribute_path(item, attribute->str()) : item, case_sensitive);
  };
  for (size_t i = 1; i < items.size(); ++i) {
    if (want_max ? less(key(items[best]), key(items[i])) : less(key(items[i]), key(items[best]))) {
      best = i;
    }
  }
  return items[best];
}
Value f_min(Renderer&, const Value& v, const CallArgs& a) { return min_max(v, a, false); }
Value f_max(Renderer&, const Value& v, const CallArgs& a) { return min_max(v, a, true); }

Value f_abs(Renderer&, const Value& v, const CallArgs&) {
  if (!v.is_number()) throw TemplateError("bad operand type for abs(): '" + v.type_name() + "'");
  return v.is_integral() ? Value::integer(std::llabs(v.as_int()))
                         : Value::number(std::fabs(v.as_double()));
}

Value f_round(Renderer&, const Value& v, const CallArgs& a) {
  if (!v.is_number()) throw TemplateError("round: expected a number, got " + v.type_name());
  const int64_t precision = arg_int(a, 0, "precision", 0);
  const std::string method = arg_str(a, 1, "method", "common");
  const double scale = std::pow(10.0, double(precision));
  const double x = v.as_double() * scale;
  double rounded;
  if (method == "common") {
    rounded = std::nearbyint(x);  // Python's round(): half to even
  } else if (method == "ceil") {
    rounded = std::ceil(x);
  } else if (method == "floor") {
    rounded = std::floor(x);
  } else {
    throw TemplateError("round: method must be common, ceil or floor");
  }
  return Value::number(rounded / scale);
}

Value f_safe(Renderer&, const Value& v, const CallArgs&) { return v; }

Value f_escape(Renderer&, const Value& v, const CallArgs&) {
  return Value::string(html_escape(v.str()));
}

// Attributes only (a dict's items are not attributes here, unlike `obj.name`).
Value f_attr(Renderer&, const Value& v, const CallArgs& a) {
  const std::string name = arg_str(a, 0, "name", "");
  if (v.is_dict() && !v.as_dict().is_namespace) {
    Value method = find_method(v, name);
    return method.is_undefined() ? Value::undefined("'dict object' has no attribute '" + name + "'")
                                 : method;
  }
  return get_attribute(v, name);
}

Value f_count(Renderer& r, const Value& v, const CallArgs& a) { return f_length(r, v, a); }

Value f_indent(Renderer& r, const Value& v, const CallArgs& a) {
  const Value* width = arg(a, 0, "width");
  const std::string indent = width == nullptr ? "    "
                             : width->is_string()
                                 ? width->as_string()
                                 : std::string(size_t(std::max<int64_t>(width->as_int(), 0)), ' ');
  const bool first = arg_bool(a, 1, "first", false);
  const bool blank = arg_bool(a, 2, "blank", false);
  const std::string s = v.str() + "\n";
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < s.size()) {
    const size_t nl = s.find('\n', start);
    lines.push_back(s.substr(start, nl - start));
    start = nl + 1;
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n";
    if (i > 0 && (blank || !lines[i].empty())) out += indent;
    out += lines[i];
  }
  if (first) out = indent + out;
  r.check_size(out.size());
  return Value::string(std::move(out));
}

}  // namespace

FilterFn find_filter(const std::string& name) {
  static const std::map<std::string, FilterFn> kFilters = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"capitalize", f_capitalize},
      {"count", f_count},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"forceescape", f_escape},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"unique", f_unique},
      {"upper", f_upper},
  };
  auto it = kFilters.find(name);
  return it == kFilters.end() ? nullptr : it->second;
}

}  // namespace treeserve::jinja
