"""One evaluator per measurement, used by the evaluate stage and by bench/.

perplexity (perplexities), harness (lm-eval tasks), drift (error flow), acceptance (alpha and
tau per scenario, pair costs), speed (decode speed on the runtime); result holds EvalResult.
"""
