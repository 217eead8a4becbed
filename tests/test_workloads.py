"""Workload files: kvsim's CSV and the public traces (Azure LLM inference, BurstGPT, Mooncake),
each written here in its published layout; bad input is one line, exit 2, with its line."""

import json
import os

import numpy as np
import pytest
from conftest import run_cli

from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.sim import workload as W

AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.0000000,1000,7
"""
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,2162,5
2024-05-10 00:00:00+00:00,76,15
2024-05-10 02:00:01.500000+02:00,10,1
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118.5,GPT-4,417,276,693,API log
7,GPT-4,300,0,300,API log
9.25,ChatGPT,20,1,21,Conversation log
"""
MOONCAKE = [
    {"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]},
    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 3]},
    {"timestamp": 1500, "input_length": 512, "output_length": 1, "hash_ids": [4]},
]
KVSIM = "arrival,prompt,output\n1.0,1000,10\n0.5,2000,20\n2.5,500,5\n"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def replay(capsys, *args):
    """``kvsim replay ARGS`` in this process (the same entry point as the command line, without
    a new interpreter per case); (exit status, stdout, stderr)."""
    try:
        code = main(["replay", *map(str, args)])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_azure_2023_and_2024_times(tmp_path):
    w = W.from_file(write(tmp_path, "code.csv", AZURE_2023))
    assert w.arrival == pytest.approx([0, 0.31941, 4.314579], abs=1e-9)  # sorted, from 0
    assert w.prompt.tolist() == [374, 1000, 396] and w.output.tolist() == [44, 7, 109]
    assert w.concurrency is None and w.prefix_hashes is None
    assert "azure" in w.description and "code.csv" in w.description
    assert "3 requests used" in w.description and "0 skipped" in w.description
    # zones: +00:00, none on whole seconds, +02:00 (= 00:00:01.5 UTC)
    w = W.from_file(write(tmp_path, "conv_1week.csv", AZURE_2024))
    assert w.arrival == pytest.approx([0, 0.00993, 1.5], abs=1e-9)
    assert w.prompt.tolist() == [76, 2162, 10] and w.output.tolist() == [15, 5, 1]
    assert w.prompt.dtype == np.int64 and w.arrival.dtype == np.float64


def test_burstgpt_skips_failures_and_says_so(tmp_path):
    w = W.from_file(write(tmp_path, "BurstGPT_1.csv", BURSTGPT))
    assert w.arrival == pytest.approx([0, 4.25, 113.5])  # seconds from the earliest kept
    assert w.prompt.tolist() == [472, 20, 417] and w.output.tolist() == [18, 1, 276]
    assert (w.output >= 1).all()
    assert "3 requests used of 5 read" in w.description
    assert "2 skipped (0 response tokens" in w.description


def test_mooncake_keeps_hashes_in_arrival_order(tmp_path):
    w = W.from_file(write(tmp_path, "conversation_trace.jsonl", jsonl(MOONCAKE)))
    assert w.arrival == pytest.approx([0, 1.5, 3.0])  # milliseconds -> seconds
    assert w.prompt.tolist() == [6758, 512, 700] and w.output.tolist() == [500, 1, 5]
    assert w.prefix_hashes == [[0, 1, 3], [4], [0, 2]]
    assert "mooncake" in w.description and "hash_ids kept" in w.description


def test_kvsim_csv_keeps_its_arrivals(tmp_path):
    w = W.from_file(write(tmp_path, "w.csv", KVSIM))
    assert w.arrival.tolist() == [0.5, 1.0, 2.5]  # sorted, as written (not moved to 0)
    assert w.prompt.tolist() == [2000, 1000, 500] and w.output.tolist() == [20, 10, 5]
    assert W.from_csv(tmp_path / "w.csv").arrival.tolist() == [0.5, 1.0, 2.5]


def test_time_scale_and_limit(tmp_path):
    path = write(tmp_path, "b.csv", BURSTGPT)
    w = W.from_file(path, time_scale=0.5)
    assert w.arrival == pytest.approx([0, 2.125, 56.75])  # twice the rate
    assert "time scale 0.5" in w.description and "span 56.75 s" in w.description
    w = W.from_file(path, limit=2, time_scale=2)
    assert w.n == 2 and w.arrival == pytest.approx([0, 8.5]) and w.prompt.tolist() == [472, 20]
    assert "2 requests used" in w.description and "--limit" in w.description
    assert W.from_file(path, limit=99).n == 3
    m = W.from_file(write(tmp_path, "m.jsonl", jsonl(MOONCAKE)), limit=2)
    assert m.prefix_hashes == [[0, 1, 3], [4]]
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(KvsimError, match="--time-scale"):
            W.from_file(path, time_scale=bad)
    with pytest.raises(KvsimError, match="--limit"):
        W.from_file(path, limit=0)


def test_auto_detection_and_forced_formats(tmp_path):
    files = {"azure": AZURE_2023, "burstgpt": BURSTGPT, "mooncake": jsonl(MOONCAKE),
             "kvsim": KVSIM}
    for fmt, text in files.items():
        path = write(tmp_path, f"{fmt}.txt", text)  # the name plays no part
        assert f"({fmt})" in W.from_file(path).description
        assert W.from_file(path, fmt).n == W.from_file(path).n
    with pytest.raises(KvsimError, match="burstgpt format needs columns"):
        W.from_file(tmp_path / "azure.txt", "burstgpt")
    with pytest.raises(KvsimError, match="line 1: not JSON"):
        W.from_file(tmp_path / "azure.txt", "mooncake")
    # a BOM and spaces around the header names are tolerated
    w = W.from_file(write(tmp_path, "bom.csv", "\ufeffTIMESTAMP, ContextTokens ,GeneratedTokens\n"
                          "2023-11-16 18:15:46.6805900,374,44\n"))
    assert w.prompt.tolist() == [374]


def test_blank_lines_and_chunks(tmp_path, monkeypatch):
    """A blank line sends the reader to its text pass: same requests, same line numbers; the
    line of a bad row is right across chunk boundaries."""
    plain = W.from_file(write(tmp_path, "a.csv", AZURE_2023))
    gaps = W.from_file(write(tmp_path, "b.csv", AZURE_2023.replace("\n2023", "\n\n2023", 1)
                             + "\n"))
    assert gaps.arrival.tolist() == plain.arrival.tolist() and gaps.n == 3
    monkeypatch.setattr(W, "CHUNK_ROWS", 2)
    assert W.from_file(tmp_path / "a.csv").arrival.tolist() == plain.arrival.tolist()
    rows = "".join(f"2023-11-16 18:15:{i:02d}.5,{10 + i},3\n" for i in range(8))
    bad = rows.replace("18:15:05.5,15,3", "18:15:05.5,15,3.5")
    with pytest.raises(KvsimError, match=r"line 7: GeneratedTokens '3.5' is not a whole"):
        W.from_file(write(tmp_path, "c.csv", AZURE_2023.splitlines()[0] + "\n" + bad))
    with pytest.raises(KvsimError, match=r"line 8: GeneratedTokens 'x'"):
        W.from_file(write(tmp_path, "d.csv", AZURE_2023.splitlines()[0] + "\n\n" +
                          rows.replace("18:15:05.5,15,3", "18:15:05.5,15,x")))


AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
BG = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
MC = json.dumps(MOONCAKE[0]) + "\n"


@pytest.mark.parametrize("name, text, message", [
    ("t.csv", AZ + "2023-11-16 18:15:47.0,374,abc\n",
     "t.csv line 3: GeneratedTokens 'abc' is not a whole number"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,100.7,3\n",
     "line 3: ContextTokens '100.7' is not a whole number"),
    ("t.csv", AZ + AZ.splitlines()[1] + "\n\n2023-11-16 18:15:47.0,-5,3\n",
     "line 5: ContextTokens -5 is negative"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,0,3\n",
     "line 3: ContextTokens 0: a prompt needs at least 1 token"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,5,0\n",
     "line 3: GeneratedTokens 0: a request needs at least 1 output"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,inf,3\n",
     "line 3: ContextTokens 'inf' is not a whole number"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,,3\n", "line 3: ContextTokens is empty"),
    ("t.csv", AZ + "2023-11-16 18:15:47.0,5\n", "line 3: GeneratedTokens is empty"),
    ("t.csv", AZ + "2023-13-45 99:00:00,5,3\n",
     "line 3: TIMESTAMP '2023-13-45 99:00:00' is not a date"),
    ("t.csv", BG + "nan,ChatGPT,1,2,3,API log\n", "line 2: Timestamp 'nan' is not a finite number"),
    ("t.csv", BG + "5,ChatGPT,1,2,3,API log\n-1,ChatGPT,1,2,3,API log\n",
     "line 3: Timestamp -1 is negative"),
    ("t.csv", BG + "5,ChatGPT,1,0,1,API log\n", "no requests (1 failed requests with 0 response"),
    ("t.csv", "arrival,prompt,output\n0,10,1e400\n",
     "line 2: output '1e400' is not a whole number"),
    ("t.csv", "arrival,prompt,output\n0,1e30,1\n", "line 2: prompt 1e30 is too large"),
    ("t.jsonl", json.dumps({**MOONCAKE[0], "input_length": 2**40}) + "\n",
     "line 1: input_length 1099511627776 is too large"),
    ("t.csv", AZ.splitlines()[0] + "\n", "has no requests"),
    ("t.csv", "", "the workload file is empty"),
    ("t.csv", "\n\n", "the workload file is empty"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n1,2,3,4\n",
     "line 1: column 'ContextTokens' appears more than once"),
    ("t.csv", "when,prompt_tokens\n1,2\n",
     "tried kvsim (arrival, prompt, output), azure (TIMESTAMP"),
    ("t.jsonl", MC + "{not json}\n", "t.jsonl line 2: not JSON"),
    ("t.jsonl", MC + json.dumps({**MOONCAKE[1], "output_length": 1.5}) + "\n",
     "line 2: output_length 1.5 is not a whole number"),
    ("t.jsonl", MC + "\n" + json.dumps({**MOONCAKE[1], "input_length": "7"}) + "\n",
     "line 3: input_length '7' is not a whole number"),
    ("t.jsonl", MC + json.dumps({"timestamp": 1, "input_length": 5}) + "\n",
     "line 2: no 'output_length'"),
    ("t.jsonl", MC + json.dumps({**MOONCAKE[1], "timestamp": -3}) + "\n",
     "line 2: timestamp -3 is negative"),
    ("t.jsonl", MC + json.dumps({**MOONCAKE[1], "hash_ids": "0,1"}) + "\n",
     "line 2: hash_ids '0,1' is not a list of ints"),
    ("t.jsonl", MC + "[1, 2]\n", "line 2: not a JSON object"),
])
def test_bad_files_one_line_exit_2(tmp_path, capsys, name, text, message):
    path = write(tmp_path, name, text)
    code, out, err = replay(capsys, "--workload", path, "--policy", "dense")
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--time-scale", "0"], "--time-scale must be positive and finite"),
    (["--time-scale", "nan"], "--time-scale: must be finite, got nan"),
    (["--time-scale=-inf"], "--time-scale: must be finite, got -inf"),
    (["--limit", "0"], "--limit must be a positive number"),
    (["--workload-format", "vidur"], "invalid choice"),
    (["--workload-format", "burstgpt"], "burstgpt format needs columns Timestamp, Request tokens"),
])
def test_bad_flags_one_line_exit_2(tmp_path, capsys, args, message):
    path = write(tmp_path, "a.csv", AZURE_2023)
    code, out, err = replay(capsys, "--workload", path, "--policy", "dense", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_flags_without_a_workload_file(capsys):
    code, _, err = replay(capsys, "--policy", "dense", "--limit", "3")
    assert code == 2 and "apply to a --workload file" in err


def test_non_regular_files_refused_without_blocking(tmp_path, capsys):
    code, _, err = replay(capsys, "--workload", tmp_path, "--policy", "dense")
    assert code == 2 and "it is a directory, not a regular file" in err
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.csv"
        os.mkfifo(fifo)  # opening it for reading would block: the reader must not
        code, out, err = run_cli("replay", "--workload", fifo, "--policy", "dense")
        assert code == 2 and "it is a FIFO" in err and len(err.strip().splitlines()) == 1


def test_bad_row_through_the_command_line(tmp_path):
    path = write(tmp_path, "trace.csv", AZ + "2023-11-16 18:15:47.0,374,44\n" * 14
                 + "2023-11-16 18:15:48.0,374,abc\n")
    code, out, err = run_cli("replay", "--workload", path, "--policy", "dense")
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert "trace.csv line 17: GeneratedTokens 'abc' is not a whole number" in err


def test_replay_end_to_end_on_an_azure_trace(tmp_path):
    path = write(tmp_path, "AzureLLMInferenceTrace_code.csv", AZURE_2023)
    code, out, err = run_cli("replay", "--workload", path, "--policy", "dense", "--json",
                             "--time-scale", "0.5", "--limit", "2")
    assert code == 0, err
    r = json.loads(out)
    assert r["sim"]["requests"] == 2
    prov = r["provenance"]["workload"]
    assert "Azure LLM inference trace (azure)" in prov and "time scale 0.5" in prov
    assert "2 requests used of 3 read" in prov

