"""The Python mirrors of model/backends/cpu/kernels/kvserve.h: the ctypes prototypes and the stack's
argument structs (and the experts'), checked against the header (and the structs against the layout the C
compiler gives them), so a mismatch fails here instead of corrupting memory."""

import ctypes
import re
import subprocess

from model.backends.cpu.kernels.build import HEADER, PROTOTYPES, c_compiler
from model.backends.cpu.kernels.experts import ExpertsArgs
from model.backends.cpu.stack import _Args, _Layer
from tests.require import missing

C_TYPES = {"float": ctypes.c_float, "int": ctypes.c_int, "void": None}
STRUCTS = (("layer_args", _Layer), ("stack_args", _Args), ("experts_args", ExpertsArgs))


def header_prototypes() -> dict[str, tuple[object, list[object]]]:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    found = {}
    for result, name, args in re.findall(r"^(void|int) (\w+)\(([^)]*)\);", text, flags=re.M):
        params = [] if args.strip() == "void" else [a.strip() for a in args.split(",")]
        kinds = [ctypes.c_void_p if "*" in p else C_TYPES[p.split()[0]] for p in params]
        found[name] = (C_TYPES[result], kinds)
    return found


def test_ctypes_prototypes_match_the_header() -> None:
    header = header_prototypes()
    assert set(header) == set(PROTOTYPES)
    for name, (result, args) in PROTOTYPES.items():
        assert (result, args) == header[name], name


def test_stack_structs_match_the_compilers_layout(tmp_path) -> None:
    """sizeof and every field's offsetof, as the C compiler lays out layer_args,
    stack_args and experts_args, equal the ctypes mirrors (model/backends/cpu/stack.py,
    model/backends/cpu/kernels/experts.py)."""
    compiler = c_compiler()
    if compiler is None:
        missing("cc", "no C compiler")
    lines = []
    for c_name, mirror in STRUCTS:
        lines.append(f'printf("{c_name} size %zu\\n", sizeof({c_name}));')
        for field, _ in mirror._fields_:
            lines.append(f'printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    source = tmp_path / "layout.c"
    source.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n"
        f'#include "{HEADER}"\nint main(void) {{\n' + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    exe = tmp_path / "layout"
    build = subprocess.run([compiler, str(source), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr  # a field the header lacks fails here
    c_layout = {}
    for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        struct, field, value = line.split()
        c_layout[(struct, field)] = int(value)
    for c_name, mirror in STRUCTS:
        assert c_layout[(c_name, "size")] == ctypes.sizeof(mirror), c_name
        for field, _ in mirror._fields_:
            assert c_layout[(c_name, field)] == getattr(mirror, field).offset, (c_name, field)
