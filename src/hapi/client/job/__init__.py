"""`TransferJob`: a model, a dataset and servers, assembled into a job that plans, trains,
evaluates, resumes and pushes its model. The top of the client: it reads every other package.
"""
