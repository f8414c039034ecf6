"""The server around the routes: the app and its state (`app`), middleware, metrics, drain, launch, the deploy file,
the playground, plugin routes and the offline command."""
