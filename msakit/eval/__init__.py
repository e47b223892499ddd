"""Long-context evaluation: loss by position, passkey / needle / variable tracking, RULER's 13 tasks on
RULER's data (`msakit.eval.ruler`, greedy generation under the policies), selection policies.

Works on any model whose ``forward(input_ids)`` returns ``.logits`` (msakit models, converted HF
models, plain transformers models); sparse policies need the interfaces declared in
`msakit.models.interface` (`SparseModel`, `SelectionModel`; see `msakit.eval.runner`).  `msakit eval` is the command line.
"""

from __future__ import annotations

from msakit.eval.documents import Document, long_documents
from msakit.eval.generation import greedy_generate
from msakit.eval.hf_policy import HFPolicyModel
from msakit.eval.policies import POLICY_NAMES, Policy, make_policy, oracle_block_idx, window_block_idx
from msakit.eval.report import markdown_table, summarize, write_report
from msakit.eval.ruler import RULER_TASKS, RulerData, RulerGenerator, RulerSample, ruler_score
from msakit.eval.runner import (TASKS, EvalConfig, check_out, configure_model, grid_of, parse_policy, read_records,
                               run_eval)
from msakit.eval.scoring import answer_scores, bucket_edges, bucket_sums, model_logits, token_nll
from msakit.eval.tasks import RETRIEVAL_TASKS, Sample, encoder, make_sample, make_samples

__all__ = [
    "Document", "EvalConfig", "HFPolicyModel", "POLICY_NAMES", "Policy", "RETRIEVAL_TASKS", "RULER_TASKS",
    "RulerData", "RulerGenerator", "RulerSample", "Sample", "TASKS", "greedy_generate", "ruler_score",
    "answer_scores", "bucket_edges", "bucket_sums", "check_out", "configure_model", "grid_of", "encoder",
    "long_documents",
    "make_policy", "make_sample", "make_samples", "markdown_table", "model_logits",
    "oracle_block_idx", "parse_policy", "read_records", "run_eval", "summarize",
    "token_nll", "window_block_idx", "write_report",
]
