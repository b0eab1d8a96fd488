print('tmp')
