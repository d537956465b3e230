"""Codegen stage: the subset of Python our kernel templates emit, checked on kernel text before it is executed.

Input: a kernel's NKI source text (a ``KernelSource.source``: a rendered kernel or region kernel). Output: its
syntax tree, which the launcher compiles (runtime/launcher.py), or a ``KernelTextError`` naming the rule the text
breaks and the line. ``kernel_builtins`` gives the only builtins such a text is executed with: the two layers back
each other.

Why: the on-disk cache (runtime/disk_cache.py) keeps kernel sources that the launcher executes when a region is
loaded. A cache folder shared between users must not be a way to run code in another user's process, so text read
back from disk is executed only when it stays inside what codegen/templates/*.py.j2 and codegen/region_text.py
produce. Those texts are meta-programs over the NKI API: a docstring, ``import nki`` / ``nki.isa as nisa`` /
``nki.language as nl`` / ``nki.collectives as ncc``, and functions (``@nki.jit`` on the kernel) whose bodies
allocate tiles, loop, branch, keep tiles in lists and dicts, and call ``nisa`` instructions. The rules (``RULES``):

* ``syntax``: the text parses as Python;
* ``top level``: the module holds a docstring, imports and function definitions, nothing that runs on import;
* ``import``: only the four NKI imports above, each with its alias, at the top level;
* ``decorator``: only ``@nki.jit``, on a top-level function;
* ``construct``: only the statements and expressions the templates use (no class, lambda, try, with, global,
  yield, f-string, ...); constants are str, int, float, bool or None;
* ``underscore``: no attribute starting with an underscore, and no name, parameter or keyword starting with two,
  which shuts ``__class__`` / ``__subclasses__`` / ``__globals__`` / ``__builtins__`` / ``__import__`` out (a
  name with one, ``_tensor_constant0``, is a buffer the graph named: the ``builtin`` rule below has it bound);
* ``nki attribute``: ``nki.X``, ``nl.X``, ``nisa.X``, ``ncc.X`` only for X in the NKI API names our kernels use
  (the simulator's modules also hold their own imports, such as numpy, which a kernel must not reach);
* ``attribute``: on any other value (tiles, engines, lists, dicts) only the attributes kernels use;
* ``call``: a call's callee is a name or one of the attributes above (not a call's result, a subscript, ...);
* ``builtin``: names the text reads without binding them are the few builtins kernels use (``KERNEL_BUILTINS``);
  no ``exec``, ``eval``, ``open``, ``getattr``, ``globals``, ``__import__``, ...;
* ``binding``: the text binds no builtin's name and none of the NKI aliases (so the two rules above mean what
  they say).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import gc

RULES = ("syntax", "top level", "import", "decorator", "construct", "underscore", "nki attribute", "attribute",
         "call", "builtin", "binding")

# The imports a kernel may make, as (module, alias): the alias is what the text names the module by.
NKI_IMPORTS = frozenset({("nki", None), ("nki.isa", "nisa"), ("nki.language", "nl"), ("nki.collectives", "ncc")})
NKI_ALIASES = frozenset({"nki", "nisa", "nl", "ncc"})
KERNEL_DECORATOR = "nki.jit"

# The builtins kernel text calls (loop bounds, tile extents, the attention kernels' queues of tiles), and only those.
KERNEL_BUILTINS = frozenset({"range", "min", "max", "len", "enumerate", "float", "tuple", "list", "dict"})

# The nki.language names codegen writes: the operators of the op table (op_table.py) and of the kernel kinds,
# buffers and the kernel dtypes (codegen/expressions.py NL_DTYPES).
NL_OPERATORS = frozenset({
    "add", "subtract", "multiply", "maximum", "minimum", "power", "equal", "not_equal", "less", "less_equal",
    "greater", "greater_equal", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "abs", "square", "exp",
    "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "gelu_dx", "gelu_apprx_tanh", "silu", "silu_dx",
    "softplus", "mish", "erf", "arctan", "sin", "reciprocal", "copy", "abs_max", "abs_min",
})
NL_NAMES = NL_OPERATORS | frozenset({
    "ndarray", "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "float32", "bfloat16", "int32", "uint8",
})
NISA_NAMES = frozenset({
    "activation", "affine_select", "dma_compute", "dma_copy", "dma_transpose", "dropout", "engine", "iota", "memset",
    "nc_matmul", "nc_transpose", "reciprocal", "scalar_tensor_tensor", "select_reduce", "set_rng_seed", "tensor_copy",
    "tensor_copy_predicated", "tensor_reduce", "tensor_scalar", "tensor_tensor", "tensor_tensor_scan",
})
NKI_API = {
    "nki": frozenset({"jit"}),
    "nl": NL_NAMES,
    "nisa": NISA_NAMES,
    "ncc": frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ReplicaGroup"}),
}
# Attributes of other values: tile views and access patterns, engine members, the lists and dicts of tile queues.
VALUE_ATTRIBUTES = frozenset({
    "ap", "view", "reshape", "reshape_dim", "vector", "scalar", "gpsimd", "append", "get", "update",
})

STATEMENTS = (ast.FunctionDef, ast.Return, ast.Assign, ast.AugAssign, ast.For, ast.While, ast.If, ast.Expr,
              ast.Delete, ast.Break, ast.Continue, ast.Pass, ast.Import)
EXPRESSIONS = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp,
               ast.GeneratorExp, ast.Compare, ast.Call, ast.Constant, ast.Attribute, ast.Subscript, ast.Starred,
               ast.Name, ast.List, ast.Tuple, ast.Slice)
# Operators only call the operand's own methods; arguments, keywords and comprehensions are parts of the nodes above.
PARTS = (ast.boolop, ast.operator, ast.unaryop, ast.cmpop, ast.comprehension, ast.arguments, ast.arg, ast.keyword,
         ast.alias)
CONSTANT_TYPES = (str, int, float, bool, type(None))
UNPLACED = 1 << 30  # the line a violation of a node without a position sorts at


@dataclasses.dataclass
class KernelTextError(ValueError):
    """Kernel text outside the subset our templates emit: the rule it breaks, where, and what was found."""

    kernel: str
    rule: str
    line: int
    detail: str
    more: int = 0  # further violations in the text, after this one in reading order

    def __str__(self) -> str:
        others = f" (and {self.more} more)" if self.more else ""
        return f"kernel {self.kernel} line {self.line}: rule '{self.rule}': {self.detail}{others}"


def check_kernel_text(source: str, kernel: str = "kernel") -> ast.Module:
    """The parsed text, which the caller compiles; ``KernelTextError`` unless it stays inside the subset (see the
    module docstring). ``kernel`` names the text in the error."""
    with _collector_paused():
        try:
            tree = ast.parse(source)
        except SyntaxError as error:
            raise KernelTextError(kernel, "syntax", error.lineno or 0, str(error.msg)) from None
        _check_top_level(tree, kernel)
        _NodeChecker(tree, kernel).run()
    return tree


@contextlib.contextmanager
def _collector_paused():
    """The garbage collector off while a text becomes tens of thousands of syntax-tree nodes: in a process holding
    torch and Dynamo (~450k tracked objects) those allocations set off full collections that cost 5-8x the parse
    itself (a region kernel of 127 KB: ~35 ms parsed, ~250 ms with a collection). The tree has no cycles, so
    reference counting frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def kernel_builtins(import_hook) -> dict:
    """The ``__builtins__`` kernel text runs with: ``KERNEL_BUILTINS``, and ``import_hook`` (the launcher's, which
    binds ``nki`` to its modules) for the ``nki`` package only."""

    def nki_only_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - __import__ signature
        if level != 0 or name.split(".")[0] != "nki":
            raise ImportError(f"kernel text imports the nki package only, not {name!r}")
        return import_hook(name, globals, locals, fromlist, level)

    return {**{name: getattr(builtins, name) for name in KERNEL_BUILTINS}, "__import__": nki_only_import}


def _fail(kernel: str, rule: str, node: ast.AST, detail: str):
    raise KernelTextError(kernel, rule, getattr(node, "lineno", 0), detail)


def _check_top_level(tree: ast.Module, kernel: str) -> None:
    for index, statement in enumerate(tree.body):
        if isinstance(statement, ast.ImportFrom):
            _fail(kernel, "import", statement, f"`{_text(statement)}` (kernels import nki modules with `import`)")
        elif isinstance(statement, ast.Import):
            _check_import(statement, kernel)
        elif isinstance(statement, ast.FunctionDef):
            for decorator in statement.decorator_list:
                if ast.unparse(decorator) != KERNEL_DECORATOR:
                    _fail(kernel, "decorator", decorator, f"@{ast.unparse(decorator)} (only @{KERNEL_DECORATOR})")
        elif not (index == 0 and _is_docstring(statement)):
            _fail(kernel, "top level", statement, f"`{_text(statement)}` (the module holds a docstring, imports and "
                  "function definitions only)")


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def _check_import(statement: ast.Import, kernel: str) -> None:
    for alias in statement.names:
        if (alias.name, alias.asname) not in NKI_IMPORTS:
            allowed = ", ".join(f"import {module}" + (f" as {as_name}" if as_name else "") for module, as_name in
                                sorted(NKI_IMPORTS, key=str))
            _fail(kernel, "import", statement, f"`{_text(statement)}` (only {allowed})")


class _NodeChecker:
    """One pass over every node below the module (its top level is checked first): the rules each node keeps, and
    the names read, checked at the end against every name the text binds. Every violation is kept; the first in
    reading order is raised (``KernelTextError.more`` counts the others)."""

    def __init__(self, tree: ast.Module, kernel: str):
        self.tree = tree
        self.kernel = kernel
        self.top_level = {id(statement) for statement in tree.body}
        self.bound: set[str] = set()
        self.reads: list[ast.Name] = []
        # ((line, column), the rule's place in RULES, rule, detail): one token may break two rules (``__import__``
        # is both "underscore" and "builtin"); the earlier in RULES is reported
        self.violations: list[tuple[tuple[int, int], int, str, str]] = []
        self.checks = {ast.Name: self.name, ast.Attribute: self.attribute, ast.Call: self.call,
                       ast.Constant: self.constant, ast.FunctionDef: self.function, ast.arg: self.parameter,
                       ast.keyword: self.keyword, ast.Import: self.nested_import}

    def run(self) -> None:
        children, checks = CHILD_FIELDS, self.checks
        stack: list = list(self.tree.body)
        while stack:
            node = stack.pop()
            if node is None:  # an absent optional part (``**`` in a dict display, a keyword-only default)
                continue
            kind = type(node)
            fields = children.get(kind)
            if fields is None:
                self.construct(node)  # not looked into: the text is refused anyway
                continue
            check = checks.get(kind)
            if check is not None:
                check(node)
            for field in fields:
                value = getattr(node, field)
                if type(value) is list:
                    stack.extend(value)
                else:
                    stack.append(value)
        for node in self.reads:
            if node.id not in self.bound and node.id not in NKI_ALIASES and node.id not in KERNEL_BUILTINS:
                self.violation(node, "builtin", f"`{node.id}` is read but never bound, and is not one of the "
                               f"builtins kernels use ({', '.join(sorted(KERNEL_BUILTINS))})")
        if self.violations:
            (line, _), _, rule, detail = min(self.violations)
            raise KernelTextError(self.kernel, rule, line, detail, len(self.violations) - 1)

    def violation(self, node: ast.AST, rule: str, detail: str, column: int | None = None) -> None:
        # a node without a position (a ``with`` item) sorts after its statement, which is refused too
        position = (getattr(node, "lineno", UNPLACED), column if column is not None else getattr(node, "col_offset", 0))
        self.violations.append((position, RULES.index(rule), rule, detail))

    def construct(self, node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            self.violation(node, "import", f"`{_text(node)}` (kernels import nki modules with `import`)")
        else:
            self.violation(node, "construct", f"{type(node).__name__} `{_text(node)}` is not used by kernel templates")

    def nested_import(self, node: ast.Import) -> None:
        if id(node) not in self.top_level:
            self.violation(node, "import", f"`{_text(node)}` inside a function (kernels import at the top level)")

    def name(self, node: ast.Name) -> None:
        self.identifier(node, node.id)
        if isinstance(node.ctx, ast.Load):
            self.reads.append(node)
        else:
            self.bind(node, node.id)

    def function(self, node: ast.FunctionDef) -> None:
        if node.decorator_list and id(node) not in self.top_level:
            self.violation(node.decorator_list[0], "decorator", f"nested function {node.name} is decorated")
        self.identifier(node, node.name)
        self.bind(node, node.name)

    def parameter(self, node: ast.arg) -> None:
        self.identifier(node, node.arg)
        self.bind(node, node.arg)

    def keyword(self, node: ast.keyword) -> None:
        if node.arg is not None:
            self.identifier(node, node.arg)

    def identifier(self, node: ast.AST, name: str) -> None:
        if name.startswith("__"):
            self.violation(node, "underscore", f"`{name}` starts with an underscore")

    def bind(self, node: ast.AST, name: str) -> None:
        if name in NKI_ALIASES or hasattr(builtins, name):
            self.violation(node, "binding", f"`{name}` is bound (a builtin's or an NKI alias's name)")
        self.bound.add(name)

    def attribute(self, node: ast.Attribute) -> None:
        column = (node.end_col_offset or 0) - len(node.attr)  # where ``.attr`` is written, after its owner
        owner = node.value
        if node.attr.startswith("_"):
            self.violation(node, "underscore", f"`.{node.attr}` starts with an underscore", column)
        elif type(owner) is ast.Name and owner.id in NKI_API:
            if node.attr not in NKI_API[owner.id]:
                self.violation(node, "nki attribute", f"`{_text(node)}` is not an NKI name kernels use", column)
        elif node.attr not in VALUE_ATTRIBUTES:
            self.violation(node, "attribute", f"`.{node.attr}` is not an attribute kernels use (those of tiles, "
                           f"engines, lists and dicts: {', '.join(sorted(VALUE_ATTRIBUTES))})", column)

    def call(self, node: ast.Call) -> None:
        if type(node.func) not in (ast.Name, ast.Attribute):
            self.violation(node, "call", f"`{_text(node.func)}` is called (a callee is a name or an attribute)",
                           node.func.end_col_offset)  # at the call's parenthesis, after the callee

    def constant(self, node: ast.Constant) -> None:
        if type(node.value) not in CONSTANT_TYPES:
            self.violation(node, "construct", f"a {type(node.value).__name__} constant `{_text(node)}`")


# The node types a kernel may hold: PARTS are abstract for the operators (ast.Add is an ast.operator).
ALLOWED_NODES = frozenset(STATEMENTS + EXPRESSIONS) | frozenset(
    kind for part in PARTS for kind in (part, *part.__subclasses__())
)
# Fields of those nodes that hold no node to look into: names, the expression context (read from ``Name.ctx``),
# operators (every one is allowed) and a constant's value.
PLAIN_FIELDS = frozenset({"id", "ctx", "attr", "arg", "name", "asname", "kind", "type_comment", "op", "ops",
                          "is_async"})
CHILD_FIELDS = {
    kind: () if kind is ast.Constant else tuple(field for field in kind._fields if field not in PLAIN_FIELDS)
    for kind in ALLOWED_NODES
}


def _text(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."
