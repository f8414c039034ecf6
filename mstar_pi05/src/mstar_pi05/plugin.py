from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_pi05.model import SPECS  # imported lazily: `mstar plugins` stays fast

    for spec in SPECS:
        register(spec)


@hookimpl
def mstar_register_routes(register):
    def policy_router():
        # imported when the server builds its app: discovery (`mstar plugins`) stays free of the web stack
        from mstar_pi05.policy_ws import router

        return router

    register(policy_router)  # openpi's websocket policy protocol at `/`
