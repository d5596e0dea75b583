// Python's str operations and call-argument reading for the Jinja builtins
// (models/detail/jinja_builtins.h).
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

#include "models/detail/jinja.h"
#include "models/detail/jinja_builtins.h"
#include "models/detail/unicode.h"

namespace treeserve::jinja {

// ---- string helpers -------------------------------------------------------------------

std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> cps;
  size_t pos = 0;
  while (pos < s.size()) cps.push_back(detail::next_char(s, &pos));
  return cps;
}

std::string from_code_points(const std::vector<uint32_t>& cps) {
  std::string out;
  for (uint32_t cp : cps) detail::append_utf8(cp, &out);
  return out;
}

std::string map_case(std::string_view s, bool upper) {
  std::vector<uint32_t> cps = code_points(s);
  for (uint32_t& cp : cps) {
    cp = uint32_t(upper ? utf8proc_toupper(utf8proc_int32_t(cp))
                        : utf8proc_tolower(utf8proc_int32_t(cp)));
  }
  return from_code_points(cps);
}

bool is_cased(uint32_t cp) {
  return utf8proc_toupper(utf8proc_int32_t(cp)) != utf8proc_int32_t(cp) ||
         utf8proc_tolower(utf8proc_int32_t(cp)) != utf8proc_int32_t(cp);
}

// Python's str.title(): a cased character after a cased one is lowered, others title-cased.
std::string python_title(std::string_view s) {
  std::vector<uint32_t> cps = code_points(s);
  bool previous_cased = false;
  for (uint32_t& cp : cps) {
    const bool cased = is_cased(cp);
    cp = uint32_t(previous_cased ? utf8proc_tolower(utf8proc_int32_t(cp))
                                 : utf8proc_totitle(utf8proc_int32_t(cp)));
    previous_cased = cased;
  }
  return from_code_points(cps);
}

std::string capitalize(std::string_view s) {
  std::vector<uint32_t> cps = code_points(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    cps[i] = uint32_t(i == 0 ? utf8proc_totitle(utf8proc_int32_t(cps[i]))
                             : utf8proc_tolower(utf8proc_int32_t(cps[i])));
  }
  return from_code_points(cps);
}

// str.strip / lstrip / rstrip: whitespace, or the characters of `chars`.
std::string strip(std::string_view s, const Value* chars, bool left, bool right) {
  std::vector<uint32_t> cps = code_points(s);
  std::vector<uint32_t> set;
  const bool whitespace = chars == nullptr || chars->is_none();
  if (!whitespace) set = code_points(chars->str());
  auto strip_it = [&](uint32_t cp) {
    return whitespace ? is_python_space(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t begin = 0, end = cps.size();
  if (left) {
    while (begin < end && strip_it(cps[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strip_it(cps[end - 1])) --end;
  }
  return from_code_points(std::vector<uint32_t>(cps.begin() + begin, cps.begin() + end));
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
  std::string out;
  size_t pos = 0;
  int64_t done = 0;
  if (from.empty()) {  // Python inserts `to` around every character
    std::vector<std::string> chars = split_chars(s);
    for (const std::string& c : chars) {
      if (count >= 0 && done >= count) {
        out += c;
        continue;
      }
      out += to + c;
      ++done;
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  while (count < 0 || done < count) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
    ++done;
  }
  return out + s.substr(pos);
}

List python_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  List parts;
  if (sep == nullptr || sep->is_none()) {  // runs of whitespace, no empty parts
    std::vector<uint32_t> cps = code_points(s);
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_python_space(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
        size_t end = cps.size();
        while (end > i && is_python_space(cps[end - 1])) --end;
        parts.push_back(Value::string(
            from_code_points(std::vector<uint32_t>(cps.begin() + i, cps.begin() + end))));
        break;
      }
      const size_t start = i;
      while (i < cps.size() && !is_python_space(cps[i])) ++i;
      parts.push_back(Value::string(
          from_code_points(std::vector<uint32_t>(cps.begin() + start, cps.begin() + i))));
    }
    return parts;
  }
  const std::string delim = sep->str();
  if (delim.empty()) throw TemplateError("empty separator");
  size_t pos = 0;
  while (maxsplit < 0 || int64_t(parts.size()) < maxsplit) {
    const size_t hit = s.find(delim, pos);
    if (hit == std::string::npos) break;
    parts.push_back(Value::string(s.substr(pos, hit - pos)));
    pos = hit + delim.size();
  }
  parts.push_back(Value::string(s.substr(pos)));
  return parts;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// ---- argument helpers -------------------------------------------------------------------

const Value* arg(const CallArgs& args, size_t index, const char* name) {
  return args.get(index, name);
}
bool arg_bool(const CallArgs& args, size_t index, const char* name, bool dflt) {
  const Value* v = args.get(index, name);
  return v ? v->truthy() : dflt;
}
int64_t arg_int(const CallArgs& args, size_t index, const char* name, int64_t dflt) {
  const Value* v = args.get(index, name);
  if (v == nullptr || v->is_none()) return dflt;
  if (!v->is_number()) throw TemplateError(std::string("argument '") + name + "' must be a number");
  return v->as_int();
}
std::string arg_str(const CallArgs& args, size_t index, const char* name, const char* dflt) {
  const Value* v = args.get(index, name);
  return v ? v->str() : dflt;
}

int64_t length_of(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return int64_t(char_count(v.as_string()));
    case Value::Kind::kList:
      return int64_t(v.as_list().size());
    case Value::Kind::kDict:
      return int64_t(v.as_dict().items.size());
    default:
      throw TemplateError("object of type '" + v.type_name() + "' has no len()");
  }
}

// `item.a.b` for an attribute path "a.b" (selectattr, map, sort, ...); a number in the path
// indexes a list.
Value attribute_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? dot : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                     [](char c) { return c >= '0' && c <= '9'; });
    v = digits ? get_item(v, Value::integer(std::atoll(part.c_str()))) : get_attribute(v, part);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

// Lower-cased strings, for the filters' case_sensitive=false comparisons.
Value fold_case(const Value& v, bool case_sensitive) {
  if (case_sensitive || !v.is_string()) return v;
  return Value::string(map_case(v.as_string(), false));
}

}  // namespace treeserve::jinja
