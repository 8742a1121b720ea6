"""feddomain on Flower: every registered method as one Flower App.

``server.app`` (the ServerApp) drives the simulator's round logic over Flower's Grid; ``client.app``
(the ClientApp) runs a method's client part on the SuperNode holding that client's data; both are
named in ``pyproject.toml`` under ``[tool.flwr.app.components]``. ``records`` converts messages,
``settings`` reads the run and node configs, ``warm`` is a forking SuperExec, ``deploy`` starts a
local SuperLink and SuperNodes, ``commands`` is ``feddomain flower``. See docs/deployment.md.
"""
