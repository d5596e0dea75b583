// What the Jinja builtins share (models/jinja_strings.cpp): Python's str operations on UTF-8
// (by code point, as Python's str works) and the reading of call arguments, for the filters
// (models/jinja_filters.cpp) and the tests, methods and globals (models/jinja_builtins.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/detail/jinja_value.h"

namespace treeserve::jinja {

// ---- str ------------------------------------------------------------------------------

std::vector<uint32_t> code_points(std::string_view s);
std::string from_code_points(const std::vector<uint32_t>& cps);
std::string map_case(std::string_view s, bool upper);  // str.upper() / str.lower()
bool is_cased(uint32_t cp);                            // has an upper or lower case form
std::string python_title(std::string_view s);          // str.title()
std::string capitalize(std::string_view s);            // str.capitalize()
// str.strip / lstrip / rstrip: whitespace, or the characters of `chars` (null or none).
std::string strip(std::string_view s, const Value* chars, bool left, bool right);
// str.replace(from, to, count); count < 0 = all.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count);
// str.split(sep, maxsplit): sep null or none splits at runs of whitespace.
List python_split(const std::string& s, const Value* sep, int64_t maxsplit);
std::string html_escape(const std::string& s);  // Jinja's escape filter

// ---- arguments and values ---------------------------------------------------------------

// Positional argument `index`, else keyword `name`: the argument, or the default.
const Value* arg(const CallArgs& args, size_t index, const char* name);
bool arg_bool(const CallArgs& args, size_t index, const char* name, bool dflt);
int64_t arg_int(const CallArgs& args, size_t index, const char* name, int64_t dflt);
std::string arg_str(const CallArgs& args, size_t index, const char* name, const char* dflt);

int64_t length_of(const Value& v);  // len(): characters, items; undefined 0
// `item.a.b` for an attribute path "a.b" (selectattr, map, sort, ...); a number in the path
// indexes a list.
Value attribute_path(const Value& item, const std::string& path);
// Lower-cased strings, for the filters' case_sensitive=false comparisons.
Value fold_case(const Value& v, bool case_sensitive);

}  // namespace treeserve::jinja
