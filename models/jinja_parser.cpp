// The Jinja parser (models/detail/jinja.h): tokens to the syntax tree, with the grammar and
// operator precedence of Jinja2's parser (loosest first): `x if c else y`, or, and, not,
// comparisons and in, + -, ~, * / // %, **, unary - +, then postfix (.attr, [item], call)
// with filters and `is` tests binding tighter than every binary operator
// ("'a' + b | trim" is 'a' + (b|trim); "not x is defined" is not (x is defined)).
#include <set>

#include "models/detail/jinja.h"

namespace treeserve::jinja {
namespace {

class Parser {
 public:
  explicit Parser(const std::vector<Token>& tokens) : t_(tokens) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, &end);
    if (cur().kind != Token::Kind::kEnd) fail("unexpected tag '" + end + "'");
    return body;
  }

 private:
  using Kind = Token::Kind;
  // Blocks and expressions nest at most this deep (a chain `a + b + c` nests once per
  // operator, as its tree does): the parser, the renderer and the tree's destructor recurse
  // once a level.
  static constexpr int kMaxDepth = 512;
  struct Nesting {
    explicit Nesting(Parser* p) : p_(p) { add(); }
    void add() {
      if (++p_->depth_ > kMaxDepth) p_->fail("nested deeper than " + std::to_string(kMaxDepth));
      ++levels_;
    }
    ~Nesting() { p_->depth_ -= levels_; }
    Parser* p_;
    int levels_ = 0;
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(i_ + n, t_.size() - 1)]; }
  void advance() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw TemplateError("line " + std::to_string(cur().line) + ": " + what);
  }
  bool is_op(const char* op) const { return cur().kind == Kind::kOperator && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == Kind::kName && cur().text == name; }
  std::string describe() const {
    switch (cur().kind) {
      case Kind::kVarEnd:
        return "'}}'";
      case Kind::kBlockEnd:
        return "'%}'";
      case Kind::kEnd:
        return "the end of the template";
      case Kind::kText:
        return "text";
      default:
        return "'" + cur().text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got " + describe());
    advance();
  }
  void expect_kind(Kind kind, const char* what) {
    if (cur().kind != kind) fail(std::string("expected ") + what + ", got " + describe());
    advance();
  }
  std::string expect_name() {
    if (cur().kind != Kind::kName) fail("expected a name, got " + describe());
    std::string name = cur().text;
    advance();
    return name;
  }

  ExprPtr make(Expr::Kind kind) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = cur().line;
    return e;
  }
  ExprPtr make_binary(Expr::Kind kind, std::string op, ExprPtr a, ExprPtr b) {
    ExprPtr e = make(kind);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }
  std::unique_ptr<Node> node(Node::Kind kind, int line) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = line;
    return n;
  }

  // ---- statements -----------------------------------------------------------------------

  // Nodes up to a {% tag %} named in `ends` (left unread past its name, returned in *end) or
  // the end of the template.
  Body parse_body(const std::set<std::string>& ends, std::string* end) {
    const Nesting nesting(this);
    Body body;
    while (true) {
      const Token& tok = cur();
      if (tok.kind == Kind::kEnd) {
        for (const std::string& e : ends) {
          if (e.rfind("end", 0) == 0) fail("missing {% " + e + " %}");
        }
        return body;
      }
      if (tok.kind == Kind::kText) {
        auto n = node(Node::Kind::kText, tok.line);
        n->text = tok.text;
        body.push_back(std::move(n));
        advance();
        continue;
      }
      if (tok.kind == Kind::kVarBegin) {
        auto n = node(Node::Kind::kOutput, tok.line);
        advance();
        n->expr = parse_tuple(true, {});
        expect_kind(Kind::kVarEnd, "'}}'");
        body.push_back(std::move(n));
        continue;
      }
      if (tok.kind != Kind::kBlockBegin) fail("unexpected " + describe());
      advance();
      if (cur().kind != Kind::kName) fail("expected a tag name, got " + describe());
      const std::string name = cur().text;
      if (ends.count(name) != 0) {
        *end = name;
        advance();
        return body;
      }
      parse_statement(name, &body);
    }
  }

  void parse_statement(const std::string& name, Body* body) {
    const int line = cur().line;
    advance();
    if (name == "if") {
      body->push_back(parse_if(line));
    } else if (name == "for") {
      body->push_back(parse_for(line));
    } else if (name == "set") {
      body->push_back(parse_set(line));
    } else if (name == "macro") {
      body->push_back(parse_macro(line));
    } else if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail("'" + name + "' outside a for loop");
      expect_kind(Kind::kBlockEnd, "'%}'");
      body->push_back(node(name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue, line));
    } else if (name == "generation") {
      // transformers' AssistantTracker block: marks the assistant's tokens; renders its body.
      expect_kind(Kind::kBlockEnd, "'%}'");
      std::string end;
      Body inner = parse_body({"endgeneration"}, &end);
      expect_kind(Kind::kBlockEnd, "'%}'");
      for (auto& n : inner) body->push_back(std::move(n));
    } else if (name == "include" || name == "extends" || name == "import" || name == "from" ||
               name == "call" || name == "filter" || name == "block" || name == "raw" ||
               name == "with" || name == "autoescape") {
      i_ -= 1;
      fail("tag '" + name + "' is not supported by treeserve's chat template interpreter");
    } else {
      i_ -= 1;
      fail("unknown tag '" + name + "'");
    }
  }

  std::unique_ptr<Node> parse_if(int line) {
    auto n = node(Node::Kind::kIf, line);
    ExprPtr cond = parse_tuple(false, {});
    while (true) {
      expect_kind(Kind::kBlockEnd, "'%}'");
      std::string end;
      Body body = parse_body({"elif", "else", "endif"}, &end);
      n->branches.emplace_back(std::move(cond), std::move(body));
      if (end == "elif") {
        cond = parse_tuple(false, {});
        continue;
      }
      if (end == "else") {
        expect_kind(Kind::kBlockEnd, "'%}'");
        Body else_body = parse_body({"endif"}, &end);
        n->branches.emplace_back(nullptr, std::move(else_body));
      }
      expect_kind(Kind::kBlockEnd, "'%}'");
      return n;
    }
  }

  // `a`, `a, b` or `(a, b)`: the names a for loop or set assigns.
  std::vector<std::string> parse_targets(const char* stop) {
    std::vector<std::string> names;
    const bool parens = is_op("(");
    if (parens) advance();
    while (true) {
      names.push_back(expect_name());
      if (!is_op(",")) break;
      advance();
      if ((parens && is_op(")")) || is_name(stop)) break;
    }
    if (parens) expect_op(")");
    return names;
  }

  std::unique_ptr<Node> parse_for(int line) {
    auto n = node(Node::Kind::kFor, line);
    n->targets = parse_targets("in");
    if (!is_name("in")) fail("expected 'in', got " + describe());
    advance();
    n->expr = parse_tuple(false, {"recursive", "if"});
    if (is_name("if")) {
      advance();
      n->filter = parse_expression(true);
    }
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_kind(Kind::kBlockEnd, "'%}'");
    ++loop_depth_;
    std::string end;
    n->body = parse_body({"endfor", "else"}, &end);
    --loop_depth_;
    if (end == "else") {
      expect_kind(Kind::kBlockEnd, "'%}'");
      n->else_body = parse_body({"endfor"}, &end);
    }
    expect_kind(Kind::kBlockEnd, "'%}'");
    return n;
  }

  std::unique_ptr<Node> parse_set(int line) {
    auto n = node(Node::Kind::kSet, line);
    std::string first = expect_name();
    if (is_op(".")) {
      advance();
      n->targets = {first};
      n->attribute = expect_name();
    } else {
      n->targets = {first};
      while (is_op(",")) {
        advance();
        if (is_op("=")) break;
        n->targets.push_back(expect_name());
      }
    }
    if (is_op("=")) {
      advance();
      n->expr = parse_tuple(true, {});
      expect_kind(Kind::kBlockEnd, "'%}'");
      return n;
    }
    if (!n->attribute.empty() || n->targets.size() != 1) fail("expected '=' in set");
    n->kind = Node::Kind::kSetBlock;
    expect_kind(Kind::kBlockEnd, "'%}'");
    std::string end;
    n->body = parse_body({"endset"}, &end);
    expect_kind(Kind::kBlockEnd, "'%}'");
    return n;
  }

  std::unique_ptr<Node> parse_macro(int line) {
    auto n = node(Node::Kind::kMacro, line);
    n->targets = {expect_name()};
    expect_op("(");
    while (!is_op(")")) {
      if (!n->params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string param = expect_name();
      ExprPtr def;
      if (is_op("=")) {
        advance();
        def = parse_expression(true);
      } else if (!n->params.empty() && n->params.back().second) {
        fail("macro parameter '" + param + "' without a default follows one with a default");
      }
      n->params.emplace_back(std::move(param), std::move(def));
    }
    advance();
    expect_kind(Kind::kBlockEnd, "'%}'");
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    std::string end;
    n->body = parse_body({"endmacro"}, &end);
    loop_depth_ = saved_loops;
    if (cur().kind == Kind::kName) advance();  // {% endmacro name %}
    expect_kind(Kind::kBlockEnd, "'%}'");
    return n;
  }

  // ---- expressions --------------------------------------------------------------------

  bool at_tuple_end(const std::set<std::string>& extra_ends) const {
    if (cur().kind == Kind::kVarEnd || cur().kind == Kind::kBlockEnd || cur().kind == Kind::kEnd ||
        is_op(")")) {
      return true;
    }
    return cur().kind == Kind::kName && extra_ends.count(cur().text) != 0;
  }

  // An expression, or several separated by commas (a tuple).
  ExprPtr parse_tuple(bool with_condexpr, const std::set<std::string>& extra_ends,
                      bool explicit_parens = false) {
    ExprPtr tuple = make(Expr::Kind::kTuple);
    bool is_tuple = false;
    while (true) {
      if (!tuple->args.empty()) expect_op(",");
      if (at_tuple_end(extra_ends)) break;
      tuple->args.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!tuple->args.empty()) return std::move(tuple->args[0]);
      if (!explicit_parens) fail("expected an expression, got " + describe());
    }
    return tuple;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    Nesting chain(this);
    while (is_name("if")) {
      chain.add();
      ExprPtr cond = make(Expr::Kind::kCond);
      advance();
      ExprPtr test = parse_or();
      ExprPtr otherwise;
      if (is_name("else")) {
        advance();
        otherwise = parse_condexpr();
      }
      cond->args.push_back(std::move(test));
      cond->args.push_back(std::move(expr));
      cond->args.push_back(std::move(otherwise));
      expr = std::move(cond);
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    Nesting chain(this);
    while (is_name("or")) {
      chain.add();
      advance();
      left = make_binary(Expr::Kind::kBinary, "or", std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    Nesting chain(this);
    while (is_name("and")) {
      chain.add();
      advance();
      left = make_binary(Expr::Kind::kBinary, "and", std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    const Nesting nesting(this);
    if (is_name("not")) {
      ExprPtr e = make(Expr::Kind::kNot);
      advance();
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().kind == Kind::kOperator &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" ||
           cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        advance();
      } else if (is_name("in")) {
        op = "in";
        advance();
      } else if (is_name("not") && peek().kind == Kind::kName && peek().text == "in") {
        op = "notin";
        advance();
        advance();
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Kind::kCompare);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    Nesting chain(this);
    while (is_op("+") || is_op("-")) {
      chain.add();
      std::string op = cur().text;
      advance();
      left = make_binary(Expr::Kind::kBinary, op, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    Nesting chain(this);
    while (is_op("~")) {
      chain.add();
      advance();
      left = make_binary(Expr::Kind::kBinary, "~", std::move(left), parse_math2());
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    Nesting chain(this);
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      chain.add();
      std::string op = cur().text;
      advance();
      left = make_binary(Expr::Kind::kBinary, op, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    Nesting chain(this);
    while (is_op("**")) {
      chain.add();
      advance();
      left = make_binary(Expr::Kind::kBinary, "**", std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Nesting nesting(this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make(is_op("-") ? Expr::Kind::kNeg : Expr::Kind::kPos);
      advance();
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& tok = cur();
    ExprPtr e = make(Expr::Kind::kConst);
    switch (tok.kind) {
      case Kind::kName:
        if (tok.text == "true" || tok.text == "True") {
          e->value = Value::boolean(true);
        } else if (tok.text == "false" || tok.text == "False") {
          e->value = Value::boolean(false);
        } else if (tok.text == "none" || tok.text == "None") {
          e->value = Value::none();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = tok.text;
        }
        advance();
        return e;
      case Kind::kString: {
        std::string s;
        while (cur().kind == Kind::kString) {  // adjacent literals concatenate
          s += cur().text;
          advance();
        }
        e->value = Value::string(std::move(s));
        return e;
      }
      case Kind::kInteger:
        e->value = Value::integer(tok.integer);
        advance();
        return e;
      case Kind::kFloat:
        e->value = Value::number(tok.number);
        advance();
        return e;
      case Kind::kOperator:
        if (tok.text == "(") {
          advance();
          ExprPtr inner = parse_tuple(true, {}, true);
          expect_op(")");
          return inner;
        }
        if (tok.text == "[") {
          e->kind = Expr::Kind::kList;
          advance();
          while (!is_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("]")) break;
            e->args.push_back(parse_expression(true));
          }
          advance();
          return e;
        }
        if (tok.text == "{") {
          e->kind = Expr::Kind::kDict;
          advance();
          while (!is_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("}")) break;
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
          }
          advance();
          return e;
        }
        break;
      default:
        break;
    }
    fail("unexpected " + describe());
  }

  ExprPtr parse_postfix(ExprPtr node) {
    Nesting chain(this);
    while (true) {
      if (is_op(".") || is_op("[") || is_op("(")) chain.add();
      if (is_op(".")) {
        advance();
        if (cur().kind == Kind::kInteger) {
          ExprPtr item = make(Expr::Kind::kGetitem);
          ExprPtr index = make(Expr::Kind::kConst);
          index->value = Value::integer(cur().integer);
          advance();
          item->args.push_back(std::move(node));
          item->args.push_back(std::move(index));
          node = std::move(item);
        } else {
          ExprPtr attr = make(Expr::Kind::kGetattr);
          attr->name = expect_name();
          attr->args.push_back(std::move(node));
          node = std::move(attr);
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node), Expr::Kind::kCall);
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    ExprPtr e = make(Expr::Kind::kGetitem);
    advance();  // [
    e->args.push_back(std::move(node));
    ExprPtr parts[3];
    int colons = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        if (++colons > 2) fail("too many ':' in a slice");
        advance();
        continue;
      }
      if (parts[colons]) fail("expected ':' or ']', got " + describe());
      parts[colons] = parse_expression(true);
      if (colons == 0 && is_op(",")) {  // x[a, b]: a tuple as the key
        ExprPtr tuple = make(Expr::Kind::kTuple);
        tuple->args.push_back(std::move(parts[0]));
        while (is_op(",")) {
          advance();
          if (is_op("]")) break;
          tuple->args.push_back(parse_expression(true));
        }
        parts[0] = std::move(tuple);
      }
    }
    advance();  // ]
    if (colons == 0) {
      if (!parts[0]) fail("empty subscript");
      e->args.push_back(std::move(parts[0]));
      return e;
    }
    e->kind = Expr::Kind::kSlice;
    for (ExprPtr& p : parts) e->args.push_back(std::move(p));
    return e;
  }

  // Call arguments after "(": positional, then name=value.
  void parse_call_args(Expr* e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs are not supported");
      if (cur().kind == Kind::kName && peek().kind == Kind::kOperator && peek().text == "=") {
        std::string key = cur().text;
        advance();
        advance();
        e->kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e->kwargs.empty()) fail("a positional argument follows a keyword argument");
        e->args.push_back(parse_expression(true));
      }
    }
    advance();
  }

  ExprPtr parse_call(ExprPtr node, Expr::Kind kind) {
    ExprPtr e = make(kind);
    e->args.push_back(std::move(node));
    parse_call_args(e.get());
    return e;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      advance();
      name += '.';  // not `"." + expect_name()`: GCC 12 -Wrestrict false positive
      name += expect_name();
    }
    return name;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    Nesting chain(this);
    while (true) {
      if (is_op("|") || is_name("is") || is_op("(")) chain.add();
      if (is_op("|")) {
        advance();
        ExprPtr f = make(Expr::Kind::kFilter);
        f->name = dotted_name();
        if (find_filter(f->name) == nullptr) fail("no filter named '" + f->name + "'");
        f->args.push_back(std::move(node));
        if (is_op("(")) parse_call_args(f.get());
        node = std::move(f);
      } else if (is_name("is")) {
        advance();
        ExprPtr t = make(Expr::Kind::kTest);
        if (is_name("not")) {
          t->negated = true;
          advance();
        }
        t->name = dotted_name();
        if (find_test(t->name) == nullptr) fail("no test named '" + t->name + "'");
        t->args.push_back(std::move(node));
        if (is_op("(")) {
          parse_call_args(t.get());
        } else if ((cur().kind == Kind::kName || cur().kind == Kind::kString ||
                    cur().kind == Kind::kInteger || cur().kind == Kind::kFloat || is_op("[") ||
                    is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail("tests cannot be chained with 'is'");
          t->args.push_back(parse_postfix(parse_primary()));
        }
        node = std::move(t);
      } else if (is_op("(")) {
        node = parse_call(std::move(node), Expr::Kind::kCall);
      } else {
        return node;
      }
    }
  }

  const std::vector<Token>& t_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace

Body parse(const std::vector<Token>& tokens) { return Parser(tokens).parse_template(); }

}  // namespace treeserve::jinja
