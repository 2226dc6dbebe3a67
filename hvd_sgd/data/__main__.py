from hvd_sgd.data import datasets

datasets.main()
