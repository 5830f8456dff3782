"""Stock vLLM engines with vLLM's own NIXL connectors behind kvhandoff's router: the pull legs
drive NixlConnector, the push legs NixlPushConnector, and each prompt gets the token ids one
engine alone gives. This is the identity check of make bench-vllm's NIXL configurations
(the bench times them); NIXL comes from PyPI (hack/nixl.sh). The engines run with NIXL's
thread placement undone (bench/sitecustomize.py), as the bench's fair configurations do: as
shipped, NIXL moves both engines' compute threads onto one core of this machine, where one
prompt has taken over the 120 s a request may, and the tokens do not depend on it."""

import pytest
from stack import MAX_TOKENS, PROMPTS, NixlStack, complete


@pytest.fixture(scope="module", params=["pull", "push"])
def nixl_stack(request, bins, tiny_model, tmp_path_factory):
    s = NixlStack(bins, tiny_model, str(tmp_path_factory.mktemp(f"nixl-{request.param}")), request.param, keep_affinity=True)
    yield request.param, s
    s.stop()


def test_stock_nixl_engines_behind_the_router_generate_what_one_engine_does(nixl_stack, reference):
    mode, s = nixl_stack
    for p in PROMPTS:
        assert complete(s.r.addr, p, MAX_TOKENS) == reference[p], f"nixl {mode}: prompt {p[:30]!r}\n{s.logs()}"
