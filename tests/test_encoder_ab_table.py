"""benchmarks/h200/encoder_ab_table.py: the A/B summary reads encoder_profile.py's results right."""
import json

import pytest

from benchmarks.h200 import encoder_ab_table


def _result(folder, B, N, C, tag, served, eager_graph, kernels=180, kernel_ms=0.5, rel=1e-3):
    r = {"B": B, "N": N, "C": C, "attn": "model", "conv": "model", "tag": tag,
         "engine_graph": {"median_ms": served}, "eager_graph": {"median_ms": eager_graph},
         "rel_l2_vs_fp32": {"engine": rel, "eager": 1.4e-3},
         "profile": {"kernels_per_solve": kernels, "kernel_ms_per_solve": kernel_ms}}
    (folder / f"encoder_profile_B{B}_N{N}_C{C}_model_{tag}.json").write_text(json.dumps(r))


def test_rows_sorted_by_key_with_main_first_and_change_against_main(tmp_path):
    _result(tmp_path, 32, 78, 400, "candidate", 3.0, 4.5)
    _result(tmp_path, 32, 78, 400, "main", 2.5, 5.0, kernels=198, kernel_ms=2.271)
    _result(tmp_path, 1, 28, 300, "main", 0.6, 0.9)
    rows = encoder_ab_table.table(encoder_ab_table.load(tmp_path))
    assert [(r[0], r[1]) for r in rows] == [("B=1 N=28 C=300", "main"), ("B=32 N=78 C=400", "main"),
                                            ("B=32 N=78 C=400", "candidate")]
    main32, cand = rows[1], rows[2]
    assert main32[2:8] == ("2.500", "5.000", "2.00x", "198", "2.271", "1.00e-03")
    assert main32[8] == ""
    assert cand[4] == "1.50x"          # 4.5 / 3.0
    assert cand[8] == "+20.0 %"        # 3.0 against main's 2.5
    text = encoder_ab_table.render(rows)
    assert text.splitlines()[0].startswith("key") and len(text.splitlines()) == 4


def test_candidate_without_main_at_its_key_has_no_change(tmp_path):
    _result(tmp_path, 8, 28, 400, "candidate", 1.0, 1.6)
    (row,) = encoder_ab_table.table(encoder_ab_table.load(tmp_path))
    assert row[1] == "candidate" and row[8] == ""


def test_empty_folder_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="no encoder_profile_.*run encoder_ab.sh"):
        encoder_ab_table.load(tmp_path)
