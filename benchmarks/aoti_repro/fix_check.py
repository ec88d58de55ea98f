"""Does linking the AOTI model .so against the SHARED libstdc++ fix the load crash? (device)

Follows benchmarks/aoti_repro/README.md's root cause (the image's g++ links libstdc++ statically
into wrapper.so; two libstdc++ copies meet at the first std::regex/locale call). For each compiler
environment: compile a tiny CUDA model with AOTI (weights not in the .so), check the .so's
libstdc++ linkage, then in a FRESH process: load, bind constants user-managed, run, compare; and
load with run_single_threaded=True, capture one call in a CUDA graph, replay, compare.

    PYTHONUNBUFFERED=1 python3 benchmarks/aoti_repro/fix_check.py        # prints a table, $OUT/fix_check.json
"""
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT") or HERE
WORK = "/tmp/aoti_fix"


def sh(cmd):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    return (r.stdout + r.stderr).strip()


def model():
    import torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda().eval()
    return m, torch.randn(8, 256, device="cuda")


def w_compile(pkg):
    import torch
    m, x = model()
    ep = torch.export.export(m, (x,))
    torch._inductor.aoti_compile_and_package(ep, package_path=pkg,
                                             inductor_configs={"aot_inductor.package_constants_in_so": False})
    print("COMPILED", flush=True)


def w_load(pkg):
    import torch
    m, x = model()
    with torch.no_grad():
        ref = m(x)
    res = {}
    for single in (False, True):
        runner = torch._inductor.aoti_load_package(pkg, run_single_threaded=single)
        print(f"STAGE loaded single={single}", flush=True)
        sd = {k: v.contiguous() for k, v in m.state_dict().items()}
        fq = runner.get_constant_fqns()
        runner.load_constants({k: sd[k] for k in fq}, check_full_update=True, user_managed=True)
        out = runner(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        res[f"err_single{int(single)}"] = ((out - ref).norm() / ref.norm()).item()
        if single:
            xs = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    runner(xs)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = runner(xs)
            gout = gout[0] if isinstance(gout, (list, tuple)) else gout
            xs.copy_(x * 2)
            g.replay()
            torch.cuda.synchronize()
            with torch.no_grad():
                ref2 = m(x * 2)
            res["graph_err"] = ((gout - ref2).norm() / ref2.norm()).item()
            # user-managed: an in-place weight update must be seen without reloading
            with torch.no_grad():
                m[0].weight.mul_(0.5)
                ref3 = m(x)
            out3 = runner(x)
            out3 = out3[0] if isinstance(out3, (list, tuple)) else out3
            res["user_managed_err"] = ((out3 - ref3).norm() / ref3.norm()).item()
    print("RESULT " + json.dumps(res), flush=True)


def elf(pkg):
    import zipfile
    d = pkg + ".x"
    shutil.rmtree(d, ignore_errors=True)
    zipfile.ZipFile(pkg).extractall(d)
    sos = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".so")]
    info = {}
    for so in sos:
        needed = sh(f"readelf -d {so} | grep NEEDED")
        syms = sh(f"nm -D --defined-only {so} | grep -c '_ZNSt6locale' || true")
        info[os.path.basename(so)] = {"needs_libstdcxx": "libstdc++" in needed, "defines_locale_syms": syms}
    return info


def main():
    diag = {k: sh(c) for k, c in {
        "which_gxx": "which -a g++ c++; echo CXX=$CXX CUDAHOSTCXX=$CUDAHOSTCXX",
        "gxx_version": "g++ --version | head -1; /usr/bin/g++ --version 2>&1 | head -1",
        "libstdcxx_so": "g++ -print-file-name=libstdc++.so; g++ -print-file-name=libstdc++.a",
        "usr_libstdcxx": "ls -l /usr/lib/x86_64-linux-gnu/libstdc++.so* 2>&1 | head -3",
        "gxx_specs_static": "g++ -dumpspecs | grep -c static-libstdc || true",
    }.items()}
    print(json.dumps(diag, indent=1), flush=True)
    os.makedirs(WORK, exist_ok=True)
    os.makedirs("/tmp/stdcxx", exist_ok=True)
    so6 = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
    if os.path.exists(so6) and not os.path.exists("/tmp/stdcxx/libstdc++.so"):
        os.symlink(so6, "/tmp/stdcxx/libstdc++.so")
    variants = {"default": {}, "LIBRARY_PATH": {"LIBRARY_PATH": "/tmp/stdcxx"}}
    if os.path.exists("/usr/bin/g++"):
        variants["CXX=/usr/bin/g++"] = {"CXX": "/usr/bin/g++"}
        variants["both"] = {"CXX": "/usr/bin/g++", "LIBRARY_PATH": "/tmp/stdcxx"}
    rows = []
    for name, env_extra in variants.items():
        pkg = os.path.join(WORK, name.replace("/", "_").replace("=", "_") + ".pt2")
        env = {**os.environ, **env_extra, "TORCHINDUCTOR_CACHE_DIR": os.path.join(WORK, "cache_" + str(len(rows)))}
        row = {"variant": name}
        t0 = time.time()
        r = subprocess.run([sys.executable, __file__, "compile", pkg], env=env, capture_output=True, text=True, timeout=240)
        row["compile_s"] = round(time.time() - t0, 1)
        row["compile_ok"] = "COMPILED" in r.stdout
        if not row["compile_ok"]:
            row["compile_err"] = (r.stderr or r.stdout)[-400:]
            rows.append(row)
            continue
        row["elf"] = elf(pkg)
        try:
            r = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "load", pkg], env=env,
                               capture_output=True, text=True, timeout=90)
            row["load_rc"] = r.returncode
            res = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            row.update(json.loads(res[0][7:]) if res else {"load_tail": (r.stdout + r.stderr)[-400:]})
        except subprocess.TimeoutExpired:
            row["load_rc"] = "hang(90s)"
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "fix_check.json"), "w") as f:
        json.dump({"diag": diag, "rows": rows}, f, indent=1)
    print("\n%-22s %8s %10s %10s %10s %10s %10s" % ("variant", "compile", "libstdc++", "load rc", "err", "graph", "usr-mgd"))
    for r in rows:
        so = next(iter(r.get("elf", {}).values()), {})
        print("%-22s %8s %10s %10s %10s %10s %10s" % (
            r["variant"], r["compile_s"], "shared" if so.get("needs_libstdcxx") else "static?", r.get("load_rc"),
            "%.1e" % r["err_single1"] if "err_single1" in r else "-", "%.1e" % r["graph_err"] if "graph_err" in r else "-",
            "%.1e" % r["user_managed_err"] if "user_managed_err" in r else "-"))


if __name__ == "__main__":
    if len(sys.argv) == 3:
        {"compile": w_compile, "load": w_load}[sys.argv[1]](sys.argv[2])
    else:
        main()
