"""Plugins that load but misbehave: no backends hook; a hook returning garbage; reserved hooks."""

from hwkv.plugins import ConnectorSpec, StoreSpec, hookimpl


class NoHook:
    pass


class BadReturn:
    @staticmethod
    @hookimpl
    def hwkv_backends():
        return ["not a spec"]

    @staticmethod
    @hookimpl
    def hwkv_stores():
        return [StoreSpec("tp-store", "1.0", "x:Y")]

    @staticmethod
    @hookimpl
    def hwkv_connectors():
        return [ConnectorSpec("tp-conn", "1.0", "x:Y")]
