"""llmq_dependencies(): every repository llmq needs, declared for a WORKSPACE (Bazel 4.2.3, offline).

llmq's own WORKSPACE and every consumer's WORKSPACE call it (docs/consuming.md):

    load("@llmq//tools:deps.bzl", "llmq_dependencies")
    llmq_dependencies()

It declares, skipping any name the WORKSPACE already declared:
  rules_cc, remote_coverage_tools  stand-ins Bazel 4 would download (third_party/ of llmq),
  rules_java                       Debian's bazel-rules-java (/usr/share/bazel/rules/java),
  local_python                     the Python toolchain + headers (tools/local_python.bzl),
  llmq_platform                    backend gating: CUDA device / MLX runtime present,
and registers the Python toolchain. `python_interpreter` picks the interpreter (see
tools/local_python.bzl; $LLMQ_PYTHON_INTERPRETER overrides it).
"""

load(":local_python.bzl", "local_python")
load(":platform_detect.bzl", "llmq_platform")

DEBIAN_RULES_JAVA = "/usr/share/bazel/rules/java"

def _link_children(ctx, src):
    for child in src.readdir():
        ctx.symlink(child, child.basename)

def _llmq_stand_in_impl(ctx):
    _link_children(ctx, ctx.path(ctx.attr.workspace_file).dirname)

# A repository whose files are those of a folder inside llmq (named by its WORKSPACE file's
# label, so it works wherever llmq itself lives: checkout, local_repository, git_repository).
_llmq_stand_in = repository_rule(
    implementation = _llmq_stand_in_impl,
    attrs = {"workspace_file": attr.label(mandatory = True, allow_single_file = True)},
)

def _system_rules_java_impl(ctx):
    src = ctx.path(ctx.attr.path)
    if not src.get_child("WORKSPACE").exists:
        fail("llmq: rules_java not found at %s; install Debian's package: sudo apt-get install bazel-rules-java" % src)
    _link_children(ctx, src)

_system_rules_java = repository_rule(
    implementation = _system_rules_java_impl,
    attrs = {"path": attr.string(mandatory = True)},
    local = True,
)

def _maybe(rule, name, **kwargs):
    if not native.existing_rule(name):
        rule(name = name, **kwargs)

def llmq_dependencies(python_interpreter = ""):
    """Declares llmq's repositories and registers its Python toolchain (see the file's docstring)."""
    _maybe(_llmq_stand_in, "rules_cc", workspace_file = Label("//third_party/rules_cc:WORKSPACE"))
    _maybe(
        _llmq_stand_in,
        "remote_coverage_tools",
        workspace_file = Label("//third_party/remote_coverage_tools:WORKSPACE"),
    )
    _maybe(_system_rules_java, "rules_java", path = DEBIAN_RULES_JAVA)
    _maybe(local_python, "local_python", python_interpreter = python_interpreter)
    _maybe(llmq_platform, "llmq_platform", python_interpreter = python_interpreter)
    native.register_toolchains("@local_python//:python_toolchain")
