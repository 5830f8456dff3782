"""kvhandoff's vLLM KV connector: the KV handoff through the node's transfer agent."""

__all__ = ["KVHandoffConnector"]


def __getattr__(name):
    # vLLM imports kvhandoff_vllm.connector itself; importing the package alone (for
    # its agent client, in tests) must not pull in vLLM.
    if name == "KVHandoffConnector":
        from .connector import KVHandoffConnector

        return KVHandoffConnector
    raise AttributeError(name)
